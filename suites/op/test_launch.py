"""kernels.launch (Triton's launcher skipped on repeat calls) and the host-time-trimmed validation.

CPU: the cache key against Triton's own argument specialization, hit / miss / fallback logic with
a recording stand-in for Triton's launch, loud disabling, and the ops' bad-input errors called
directly (not through the public API's pre-checks). GPU: the fast path gives bitwise the results
of ``kernel[grid](...)`` across dtype and alignment changes and never reuses a kernel compiled for
other arguments.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from rlk_op_cases import DEVICE, make_ids, make_logits
from triton.runtime.jit import JITFunction

from kernels import device_errors, launch
from kernels.contracts import checks
from kernels.launch import CachedLaunch
from kernels.ops import logp as logp_op
from kernels.ops import ratio_kl as ratio_kl_op


def _kernel_fn(x_ptr, y_ptr, n, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr):
    """Signature stand-in for a kernel (never compiled): 5 runtime params, 2 constexprs."""


def _one_arg_fn(x):
    """Signature stand-in: one runtime parameter."""


def _jit(fn=_kernel_fn) -> CachedLaunch:
    # a JITFunction whatever TRITON_INTERPRET says (triton.jit would give an InterpretedFunction)
    return CachedLaunch(JITFunction(fn))


# ---------------------------------------------------------------- the key vs Triton's specialization


def _triton_specialization(value):
    native = pytest.importorskip("triton._C.libtriton", reason="triton's native specializer is needed")
    try:
        from triton.backends.nvidia.compiler import CUDABackend as backend
    except ImportError:
        from triton.backends.compiler import BaseBackend as backend
    return native.native_specialize_impl(backend, value, False, True, True)


def _sample_values():
    base = torch.empty(64, dtype=torch.float32)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -100, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1,
            -(2**31) - 16, 2**40, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
    tensors = [base, base[1:], base[4:], base[8:], torch.empty(8, dtype=torch.bfloat16), torch.empty(8)[3:],
               torch.empty(8, dtype=torch.int64), torch.empty(9, dtype=torch.int32)[1:],
               torch.empty(4, dtype=torch.bool),
               torch.empty(8, dtype=torch.float16)[1:]]
    return ints + [0.5, 1.0, 2.0, -3.25, True, False, None] + tensors


def _key(fast, *args, **kwargs):
    bound = fast.bind(*args, **kwargs)
    assert bound is not None
    return bound[0]


def test_equal_keys_mean_equal_triton_specialization():
    """Soundness: two arguments with one key never get two specializations from Triton."""
    fast = _jit(_one_arg_fn)
    seen: dict[object, tuple] = {}
    for value in _sample_values():
        spec = _triton_specialization(value)
        key = _key(fast, value)
        assert seen.setdefault(key, spec) == spec, f"{value!r}: key {key!r} covers {seen[key]} and {spec}"
    assert len(seen) >= 12  # the samples do exercise many classes


@pytest.mark.parametrize(("a", "b"), [
    (16, 17), (1, 2), (1, 17), (2**31 - 1, 2**31), (-(2**31), -(2**31) - 1), (2**63 - 16, 2**63), (1.0, 1), (True, 1),
    (None, 0),
])
def test_key_separates_what_triton_separates(a, b):
    fast = _jit(_one_arg_fn)
    assert _key(fast, a) != _key(fast, b)


def test_key_of_tensors_is_dtype_16_byte_alignment_and_device():
    fast = _jit(_one_arg_fn)
    base = torch.empty(64, dtype=torch.float32)
    assert _key(fast, base) == _key(fast, base[4:])
    assert _key(fast, base[1:]) == _key(fast, base[2:]) != _key(fast, base)
    assert _key(fast, base) != _key(fast, base.to(torch.bfloat16))
    assert _key(fast, 16) == _key(fast, 4096) and _key(fast, 3) == _key(fast, 1031)  # no key per value
    if torch.cuda.is_available():
        assert _key(fast, base) != _key(fast, base.cuda())


def test_launch_arguments_are_pointers_and_values_in_signature_order():
    fast = _jit()
    x, y = torch.empty(8), torch.empty(8, dtype=torch.int32)
    key, args = fast.bind(x, y, 8, 0.5, True, BLOCK=128, MODE=2, num_warps=4)
    assert args == (x.data_ptr(), y.data_ptr(), 8, 0.5, True, 128, 2)
    assert key[-1] == ("num_warps", 4)  # launch options are keyed, not kernel arguments
    assert fast.bind(x, y, n=8, scale=0.5, flag=True, MODE=2, BLOCK=128)[1] == args


@pytest.mark.parametrize("value", [np.int64(3), np.float32(1.0), "text", torch.float32, (1, 2),
                                   torch.nn.Parameter(torch.empty(2))])
def test_unmodelled_argument_types_are_not_keyed(value):
    assert _jit(_one_arg_fn).bind(value) is None


def test_call_key_has_constexprs_and_options_by_value():
    fast = _jit()
    x = torch.empty(8)
    key = _key(fast, x, x, 8, 1.0, True, BLOCK=128, MODE=0, num_warps=4)
    assert key == _key(fast, x, x, 24, 2.0, False, BLOCK=128, MODE=0, num_warps=4)
    for change in ({"BLOCK": 256}, {"MODE": 1}, {"num_warps": 8}, {"num_stages": 2}):
        assert key != _key(fast, x, x, 8, 1.0, True, **{"BLOCK": 128, "MODE": 0, "num_warps": 4, **change})
    # a constexpr passed positionally is keyed by value; a runtime argument by keyword by its class
    assert _key(fast, x, x, 8, 1.0, True, 128, MODE=0) != _key(fast, x, x, 8, 1.0, True, 256, MODE=0)
    assert _key(fast, x, x, n=8, scale=1.0, flag=True, BLOCK=128, MODE=0) == _key(
        fast, x, x, n=24, scale=2.0, flag=False, BLOCK=128, MODE=0)
    with pytest.raises(TypeError):
        fast.bind(x, x, 8, 1.0, True, 128, 0, 99)


def test_patterns_of_argument_types_get_their_own_binder():
    fast = _jit()
    x = torch.empty(8)
    with_tensor = _key(fast, x, x, 8, 1.0, True, BLOCK=128, MODE=0)
    with_none = _key(fast, x, None, 8, 1.0, True, BLOCK=128, MODE=0)
    assert with_tensor != with_none and len(fast._binders) == 2
    assert _key(fast, x, x, 8, 1.0, True, BLOCK=128, MODE=0) == with_tensor and len(fast._binders) == 2


def test_reserved_parameter_names_are_refused():
    with pytest.raises(ValueError, match="reserved"):
        launch.binder_source([("_rlk_x", False)], ("int",))


# ---------------------------------------------------------------- hit / miss / fallback with stand-ins


class _Launcher:
    """Stands in for Triton's CudaLauncher: records calls of its C launch function."""

    def __init__(self):
        self.launches, self.launch_cooperative_grid, self.launch_pdl = [], False, False
        self.global_scratch_size = self.profile_scratch_size = 0

    def launch(self, *args):
        self.launches.append(args)


class _Compiled:
    """Stands in for Triton's CompiledKernel."""

    def __init__(self):
        self.function, self.packed_metadata, self.run = 0xF00, (4, 1, 0), _Launcher()


class _Normal:
    """Stands in for ``kernel[grid](...)``: records calls and returns a fresh compiled kernel."""

    pre_run_hooks: list = []

    def __init__(self, compiled_type=_Compiled):
        self.calls, self.compiled, self.compiled_type = [], [], compiled_type

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            self.compiled.append(self.compiled_type())
            return self.compiled[-1]
        return call


class _Runtime:
    def __init__(self):
        self.device, self.stream, self.hooked = 0, 0xABC, False

    def get_device(self):
        return self.device

    def get_stream(self, device):
        return self.stream + device

    def plain(self):
        return not self.hooked


@pytest.fixture
def stand_ins(monkeypatch):
    runtime = _Runtime()
    monkeypatch.setattr(launch, "_runtime", runtime)
    monkeypatch.setattr(launch, "_disabled", None)
    fast = _jit()
    normal = _Normal()
    fast.kernel = normal
    return fast, normal, runtime


def _launches(normal):
    return [args for compiled in normal.compiled for args in compiled.run.launches]


def test_first_call_launches_normally_then_the_compiled_kernel_directly(stand_ins):
    fast, normal, runtime = stand_ins
    x, y = torch.empty(8), torch.empty(8)
    fast.launch((3,), x, y, 8, 0.5, True, BLOCK=128, MODE=2, num_warps=4)
    assert len(normal.calls) == 1 and normal.calls[0][0] == (3,)
    assert _launches(normal) == []
    fast.launch((5, 2), x, y, 24, 0.25, False, BLOCK=128, MODE=2, num_warps=4)
    assert len(normal.calls) == 1, "a hit went through the normal launch"
    # grid padded to 3-D, current stream, function, cooperative / pdl flags, no scratch, packed
    # metadata, no launch metadata or hooks, then the arguments in signature order (tensors as
    # pointers, constexprs included; the options are not kernel arguments)
    assert _launches(normal) == [(5, 2, 1, 0xABC, 0xF00, False, False, None, None, (4, 1, 0), None, None, None,
                                  x.data_ptr(), y.data_ptr(), 24, 0.25, False, 128, 2)]


def test_a_misaligned_tensor_does_not_reuse_the_aligned_kernel(stand_ins):
    fast, normal, _ = stand_ins
    base = torch.empty(64)
    fast.launch((1,), base, base, 8, 0.5, True, BLOCK=128, MODE=0)
    fast.launch((1,), base[1:], base, 8, 0.5, True, BLOCK=128, MODE=0)
    assert len(normal.calls) == 2 and _launches(normal) == []
    fast.launch((1,), base[2:], base, 8, 0.5, True, BLOCK=128, MODE=0)  # misaligned again: the second kernel
    assert len(normal.calls) == 2 and len(normal.compiled[1].run.launches) == 1
    fast.launch((1,), base.double(), base, 8, 0.5, True, BLOCK=128, MODE=0)  # another dtype: compile again
    fast.launch((1,), base, base, 1, 0.5, True, BLOCK=128, MODE=0)  # n == 1 is a constexpr to Triton
    fast.launch((1,), base, base, 8, 0.5, True, BLOCK=64, MODE=0)
    fast.launch((1,), base, base, 8, 0.5, True, BLOCK=128, MODE=0, num_warps=8)
    assert len(normal.calls) == 6
    assert len(fast._cache) == 6


def test_other_device_misses(stand_ins):
    fast, normal, runtime = stand_ins
    x = torch.empty(8)
    fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    runtime.device = 1
    fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    assert len(normal.calls) == 2
    fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    assert normal.compiled[1].run.launches[0][3] == 0xABC + 1  # device 1's current stream


def test_launch_hooks_take_the_normal_launch(stand_ins):
    fast, normal, runtime = stand_ins
    x = torch.empty(8)
    fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    runtime.hooked = True  # a profiler hooked launches: Triton's launcher must call it
    fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    assert len(normal.calls) == 2 and _launches(normal) == []


def test_torch_compile_tracing_sees_the_normal_launch(stand_ins, monkeypatch):
    fast, normal, _ = stand_ins
    monkeypatch.setattr(launch, "_is_compiling", lambda: True)
    x = torch.empty(8)
    for _ in range(3):
        fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    assert len(normal.calls) == 3 and fast._cache == {}


def test_kernels_with_scratch_keep_the_normal_launch(stand_ins):
    fast, normal, _ = stand_ins

    class WithScratch(_Compiled):
        def __init__(self):
            super().__init__()
            self.run.global_scratch_size = 128

    normal.compiled_type = WithScratch
    x = torch.empty(8)
    for _ in range(3):
        fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    assert len(normal.calls) == 3 and fast._cache == {} and launch.disabled_reason() is None


def test_kernels_with_pre_run_hooks_keep_the_normal_launch(stand_ins, monkeypatch):
    fast, normal, _ = stand_ins
    monkeypatch.setattr(normal, "pre_run_hooks", [lambda *args, **kwargs: None])
    x = torch.empty(8)
    for _ in range(3):
        fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    assert len(normal.calls) == 3 and _launches(normal) == []


@pytest.mark.parametrize("grid", [lambda meta: (1,), [1]])
def test_uncacheable_calls_take_the_normal_launch(stand_ins, grid):
    fast, normal, _ = stand_ins
    x = torch.empty(8)
    for _ in range(2):
        fast.launch(grid, x, x, 8, 0.5, True, BLOCK=128, MODE=0)
        fast.launch((1,), x, x, np.int32(8), 0.5, True, BLOCK=128, MODE=0)
        fast.launch((1,), x, x, 8, 0.5, True, BLOCK=[128], MODE=0)  # unhashable constexpr
        fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0, num_ctas=[1])  # unhashable option
    assert len(normal.calls) == 8 and fast._cache == {}


def test_bad_arguments_reach_triton(stand_ins):
    fast, normal, _ = stand_ins
    x = torch.empty(8)
    fast.launch((1,), x, x, 8, 0.5, True, 128, 0, 99)  # one too many: Triton's launch raises
    fast.launch((1,), x, x, 8, 0.5, BLOCK=128, MODE=0)  # one missing
    assert len(normal.calls) == 2 and fast._cache == {}


class _Unloaded(_Compiled):  # an internal API that moved: no loaded function after a launch
    def __init__(self):
        super().__init__()
        self.function = None


class _Moved(_Compiled):  # the launcher became a plain callable: no .launch, no scratch sizes
    def __init__(self):
        super().__init__()
        self.run = lambda *args: None


@pytest.mark.parametrize(("compiled_type", "reason"), [(_Unloaded, "not loaded"), (_Moved, "'launch'")],
                         ids=["no-loaded-function", "no-launch-method"])
def test_unexpected_compiled_kernel_disables_loudly_once(stand_ins, caplog, compiled_type, reason):
    fast, normal, _ = stand_ins
    normal.compiled_type = compiled_type
    x = torch.empty(8)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        for _ in range(3):
            fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    assert len(normal.calls) == 3  # every call took Triton's own launch
    if compiled_type is _Unloaded:
        assert _launches(normal) == []
    assert reason in launch.disabled_reason()
    assert sum("fast kernel launch off" in r.getMessage() for r in caplog.records) == 1


def test_unverified_triton_disables_loudly_once(monkeypatch, caplog):
    monkeypatch.setattr(launch, "_runtime", None)
    monkeypatch.setattr(launch, "_disabled", None)
    monkeypatch.setattr(triton, "__version__", "3.99.0")
    fast = _jit()
    normal = _Normal()
    fast.kernel = normal
    x = torch.empty(8)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        for _ in range(3):
            fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    assert len(normal.calls) == 3 and _launches(normal) == []
    assert "triton 3.99.0 is not a verified version" in launch.disabled_reason()
    assert sum("fast kernel launch off" in r.getMessage() for r in caplog.records) == 1


def test_switch_off_keeps_the_normal_launch(stand_ins):
    fast, normal, _ = stand_ins
    launch._disable(f"switched off by {launch.ENV_SWITCH}")  # what the switch does at import
    x = torch.empty(8)
    for _ in range(3):
        fast.launch((1,), x, x, 8, 0.5, True, BLOCK=128, MODE=0)
    assert len(normal.calls) == 3 and _launches(normal) == []


def test_interpreted_kernels_always_launch_normally():
    fast = CachedLaunch(logp_op._logp_fwd_kernel)
    assert fast._compiled == isinstance(logp_op._logp_fwd_kernel, JITFunction)
    if DEVICE == "cpu":
        assert not fast._compiled  # CPU: the interpreter, through Triton's own launch


# ---------------------------------------------------------------- keyed launches (the ops' own keys)


def _keyed(fast, key, x, n=8, **constexprs):
    fast.launch_keyed(key, (2,), x, x, n, 0.5, True, **{"BLOCK": 128, "MODE": 2, **constexprs})


def test_keyed_call_stores_a_direct_launch_with_the_constexprs_appended(stand_ins):
    fast, normal, runtime = stand_ins
    x = torch.empty(8)
    assert fast.direct("k") is None  # nothing stored yet: the op calls launch_keyed
    _keyed(fast, "k", x)
    assert len(normal.calls) == 1
    direct = fast.direct("k")
    assert direct is not None
    direct(7, 0x1000, 0x2000, 24, 0.25, False)
    assert len(normal.calls) == 1, "a direct launch went through the normal launch"
    assert _launches(normal) == [(7, 1, 1, 0xABC, 0xF00, False, False, None, None, (4, 1, 0), None, None, None,
                                  0x1000, 0x2000, 24, 0.25, False, 128, 2)]


def test_a_key_that_merges_two_specializations_is_refused(stand_ins):
    fast, normal, _ = stand_ins
    base = torch.empty(64)
    _keyed(fast, "too coarse", base)
    _keyed(fast, "too coarse", base)  # same specialization: fine (a generic hit)
    with pytest.raises(launch.LaunchKeyError, match="'too coarse'.*must tell them apart"):
        _keyed(fast, "too coarse", base[1:])  # misaligned: Triton's key differs
    with pytest.raises(launch.LaunchKeyError):
        _keyed(fast, "too coarse", base, MODE=3)  # another constexpr under the same op key


def test_verify_mode_sends_every_keyed_call_through_the_check(stand_ins, monkeypatch):
    fast, normal, _ = stand_ins
    x = torch.empty(8)
    _keyed(fast, "k", x)
    monkeypatch.setattr(launch, "verify_keys", True)
    assert fast.direct("k") is None
    with pytest.raises(launch.LaunchKeyError):
        _keyed(fast, "k", x[1:])


class _CompiledWithSource(_Compiled):
    """A compiled stand-in with Triton's signature of the call (``src.signature``)."""

    signature = {"x_ptr": "*fp32", "y_ptr": "*bf16", "n": "i32", "scale": "fp32", "flag": "constexpr",
                 "BLOCK": "constexpr", "MODE": "constexpr"}

    def __init__(self):
        super().__init__()
        self.src = type("Source", (), {"signature": dict(self.signature)})()


def test_native_launch_describes_the_stored_kernel_for_cuLaunchKernel(stand_ins):
    fast, normal, _ = stand_ins
    normal.compiled_type = _CompiledWithSource
    x = torch.empty(8)
    cache_key = fast.launch_keyed("k", (2,), x, x, 8, 0.5, True, BLOCK=128, MODE=2)
    # function, 32 threads per warp x 4 warps, shared bytes, pointers / int32 / fp32 (constexprs dropped)
    assert fast.native_launch(cache_key) == (0xF00, 128, 0, "PPif")
    assert fast.launch_keyed("k", (2,), x, x, 8, 0.5, True, BLOCK=128, MODE=2) == cache_key  # a hit: same key


@pytest.mark.parametrize("change", ["cooperative", "pdl", "cluster", "u1 parameter", "no source"])
def test_native_launch_is_withheld_when_a_plain_launch_is_not_tritons(stand_ins, change):
    fast, normal, _ = stand_ins

    class Changed(_CompiledWithSource):
        def __init__(self):
            super().__init__()
            if change == "cooperative":
                self.run.launch_cooperative_grid = True
            elif change == "pdl":
                self.run.launch_pdl = True
            elif change == "cluster":
                self.packed_metadata = (4, 2, 0)
            elif change == "u1 parameter":
                self.src.signature["flag"] = "u1"
            else:
                del self.src

    normal.compiled_type = Changed
    cache_key = fast.launch_keyed("k", (2,), torch.empty(8), torch.empty(8), 8, 0.5, True, BLOCK=128, MODE=2)
    assert cache_key is not None
    assert fast.native_launch(cache_key) is None


@pytest.mark.parametrize("state", ["hooked", "compiling", "other device", "disabled"])
def test_direct_launch_is_withheld_when_the_fast_path_may_not_run(stand_ins, monkeypatch, state):
    fast, normal, runtime = stand_ins
    _keyed(fast, "k", torch.empty(8))
    assert fast.direct("k") is not None
    if state == "hooked":
        runtime.hooked = True
    elif state == "compiling":
        monkeypatch.setattr(launch, "_is_compiling", lambda: True)
    elif state == "other device":
        runtime.device = 1  # stored for device 0: device 1's stream and context are not its own
    else:
        launch._disable("test")
    assert fast.direct("k") is None


def test_kernels_without_trailing_constexprs_keep_keyed_calls_generic(stand_ins):
    def interleaved(x_ptr, BLOCK: tl.constexpr, n):
        """Signature stand-in: a constexpr before a runtime parameter."""

    fast = _jit(interleaved)
    normal = _Normal()
    fast.kernel = normal
    x = torch.empty(8)
    for _ in range(2):
        fast.launch_keyed("k", (1,), x, 64, 8)
    assert fast.direct("k") is None
    assert len(normal.calls) == 1 and len(_launches(normal)) == 1  # the second call: a generic hit


# ---------------------------------------------------------------- the ops still reject bad input


def _logits_ids(num_tokens=4, vocab=100, dtype=torch.float32):
    return make_logits(num_tokens, vocab, dtype), make_ids(num_tokens, vocab)


LOGP_ERRORS = {
    "1-D logits": (lambda: (_logits_ids()[0][0], _logits_ids()[1]), ValueError, "logits must be 2-D"),
    "fp64 logits": (lambda: (_logits_ids()[0].double(), _logits_ids()[1]), ValueError, "logits dtype"),
    "empty logits": (lambda: (_logits_ids()[0][:0], _logits_ids()[1][:0]), ValueError, "logits is empty"),
    "vocab-strided": (
        lambda: (make_logits(100, 4, torch.float32).t(), _logits_ids()[1]), ValueError, "contiguous along"),
    "ids length": (lambda: (_logits_ids()[0], make_ids(5, 100)), ValueError, r"target_ids must have shape \[4\]"),
    "ids 2-D": (lambda: (_logits_ids()[0], make_ids(4, 100)[None]), ValueError, r"target_ids must have shape \[4\]"),
    "ids float": (lambda: (_logits_ids()[0], make_ids(4, 100).float()), ValueError, "target_ids dtype"),
    "id out of range": (lambda: (_logits_ids()[0], make_ids(4, 100) + 100), ValueError, r"outside \[0, 100\)"),
    "ids not a tensor": (lambda: (_logits_ids()[0], [1, 2, 3, 4]), TypeError, "target_ids must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", LOGP_ERRORS)
@pytest.mark.parametrize("grad", [False, True])
def test_logp_op_rejects_bad_input(case, grad, monkeypatch):
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "strict")  # the ids' range at the call (on a GPU too)
    make, exc, message = LOGP_ERRORS[case]
    logits, ids = make()
    with torch.set_grad_enabled(grad), pytest.raises(exc, match=message):
        logp_op.logp(logits.requires_grad_(grad), ids)


def test_logp_op_rejects_ids_on_another_device():
    if not torch.cuda.is_available():
        pytest.skip("a device mismatch needs a CUDA device")
    logits, ids = _logits_ids()
    with torch.no_grad(), pytest.raises(ValueError, match="target_ids is on cpu but logits are on cuda"):
        logp_op.logp(logits, ids.cpu())


def test_finite_check_follows_the_environment_at_every_call(monkeypatch):
    """The checks read their switches (kernels/settings.py) through a faster os.environ lookup: set and unset still count."""
    logits, ids = _logits_ids()
    logits[1, 3] = float("nan")
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_FINITE", "1")
    with torch.no_grad(), pytest.raises(ValueError, match="logits contains 1 non-finite"):
        logp_op.logp(logits, ids)
    monkeypatch.delenv("VIME_RL_KERNEL_CHECK_FINITE")
    with torch.no_grad():
        assert torch.isnan(logp_op.logp(logits, ids)).sum() == 1
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_FINITE", "off")
    assert checks.finite_check_enabled() is False
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "0")
    assert checks.ids_check_enabled() is False
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "yes")
    assert checks.ids_check_enabled() is True


def _ratio_inputs(num_tokens=16):
    gen = torch.Generator().manual_seed(num_tokens)
    logp = -torch.rand(num_tokens, generator=gen) * 4
    return [t.to(DEVICE) for t in (logp, logp + 0.1, logp - 0.2, torch.rand(num_tokens, generator=gen) > 0.3)]


RATIO_KL_ERRORS = {
    "kl_type": (lambda i: (i, {"kl_type": "k4"}), ValueError, "kl_type must be one of"),
    "kl_type not a str": (lambda i: (i, {"kl_type": None}), ValueError, "kl_type must be one of"),
    "fp64 logp": (lambda i: ([i[0].double(), *i[1:]], {}), ValueError, "logp must be float32"),
    "int logp": (lambda i: ([i[0].long(), *i[1:]], {}), ValueError, "logp must be float32, got torch.int64"),
    "empty": (lambda i: ([x[:0] for x in i], {}), ValueError, r"logp is empty \(T == 0\)"),
    "2-D logp": (lambda i: ([i[0][None], *i[1:]], {}), ValueError, "logp must be 1-D"),
    "short old_logp": (lambda i: ([i[0], i[1][:-1], *i[2:]], {}), ValueError, r"old_logp must have shape \[16\]"),
    "int mask": (lambda i: ([*i[:3], i[3].int()], {}), ValueError, "mask must be bool or floating point"),
    "int ref_logp": (lambda i: ([i[0], i[1], i[2].int(), i[3]], {}), ValueError, "ref_logp must be a floating-point"),
}


@pytest.mark.parametrize("case", RATIO_KL_ERRORS)
def test_ratio_kl_op_rejects_bad_input(case):
    make, exc, message = RATIO_KL_ERRORS[case]
    inputs, kwargs = make(_ratio_inputs())
    with pytest.raises(exc, match=message):
        ratio_kl_op.ratio_kl(*inputs, **kwargs)


def test_ratio_kl_reads_bool_and_float_masks_alike():
    logp, old, ref, mask = _ratio_inputs(33)
    with torch.no_grad():
        a = ratio_kl_op.ratio_kl(logp, old, ref, mask, kl_type="k3")
        b = ratio_kl_op.ratio_kl(logp, old, ref, mask.float(), kl_type="k3")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert bool((a[0][~mask] == 0).all()) and bool((a[0][mask] > 0).all())


# ---------------------------------------------------------------- GPU: bitwise the normal launch


def _fwd_args(logits, ids, out):
    block, warps = logp_op.vocab_block(logits.shape[1], logits.dtype, read_only=True)
    word = device_errors.word_for(logits.device).tensor
    args = (logits, ids, out, out, out, word, logits.stride(0), logits.shape[1], 0, logits.shape[1], -100, 1.0, 0)
    return args, {"BLOCK_V": block, "SCALE": False, "PARTIAL": False, "STATS": False, "num_warps": warps}


def _require_fast_path():
    if not triton.__version__.startswith(launch.VERIFIED_TRITON):
        pytest.skip(f"triton {triton.__version__}: the fast path is off for unverified versions")
    assert launch._resolve_runtime() is not None, launch.disabled_reason()


class _CountingKernel:
    """Delegates to the real kernel and counts normal launches."""

    def __init__(self, kernel):
        self.kernel, self.pre_run_hooks, self.calls = kernel, kernel.pre_run_hooks, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.kernel[grid]


@pytest.mark.gpu
def test_fast_launch_is_bitwise_the_normal_launch_across_dtype_and_alignment():
    _require_fast_path()
    fast = CachedLaunch(logp_op._logp_fwd_kernel)
    counting = _CountingKernel(logp_op._logp_fwd_kernel)
    fast.kernel = counting
    num_tokens, vocab = 7, 32000
    cases = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.bfloat16):
        big = make_logits(num_tokens + 1, vocab + 8, dtype, seed=len(cases))
        ids = make_ids(num_tokens + 1, vocab, seed=len(cases))
        cases.append(("aligned", dtype, big[:num_tokens, :vocab], ids[:num_tokens]))
        # offset by one element: the logits and ids pointers are no longer 16-byte aligned
        cases.append(("misaligned", dtype, big[1:, 1:vocab + 1], ids[1:]))
        cases.append(("int32 ids", dtype, big[:num_tokens, :vocab], ids[:num_tokens].int()))
    expected_compiles = 0
    seen = set()
    for name, dtype, logits, ids in cases:
        for _ in range(2):  # the second call of a case is a hit
            want = torch.full((num_tokens,), float("nan"), device="cuda")
            got = torch.full((num_tokens,), float("nan"), device="cuda")
            args, kwargs = _fwd_args(logits, ids, want)
            logp_op._logp_fwd_kernel[(num_tokens,)](*args, **kwargs)
            args, kwargs = _fwd_args(logits, ids, got)
            fast.launch((num_tokens,), *args, **kwargs)
            signature = (name, dtype)
            if signature not in seen:
                seen.add(signature)
                expected_compiles += 1
            assert torch.equal(got, want), f"{name} {dtype}: fast {got.tolist()} != normal {want.tolist()}"
            assert counting.calls == expected_compiles, f"{name} {dtype}: a normal launch where a hit was due, or none"
    assert launch.disabled_reason() is None
    assert len(fast._cache) == len(seen)


def _op_calls(logits, ids, ratio_inputs):
    """The ops' keyed launches over what their keys must tell apart: dtypes, misaligned logits /
    ids / inputs, int32 ids, temperature, T % 4 (statistics rows of the [3, T] buffer), n == 1 and
    n % 16, bool / float / half masks, no-grad and with-statistics forwards."""
    stats = logp_op.logp_forward_stats
    out = [logp_op.logp(logits, ids), logp_op.logp(logits[1:], ids[1:]),
           logp_op.logp(logits[:, 1:], ids.clamp(max=logits.shape[1] - 2)), logp_op.logp(logits.float(), ids),
           logp_op.logp(logits.half(), ids.int()), logp_op.logp(logits[:1], ids[:1], 0.7),
           *stats(logits, ids, 1.0, -100, None)[:3], *stats(logits[:5], ids[:5], 0.7, -100, None)[:3],
           *stats(logits[1:], ids[1:], 1.0, -100, None)[:3]]
    for inputs in (ratio_inputs, [x[1:] for x in ratio_inputs], [*ratio_inputs[:3], ratio_inputs[3].half()],
                   [x[:1] for x in ratio_inputs], [x[:32] for x in ratio_inputs]):
        out += [*ratio_kl_op.ratio_kl(*inputs), *ratio_kl_op.ratio_kl(*inputs, kl_type="k1", use_unbiased_kl=True)]
    return out


@pytest.mark.gpu
def test_ops_fast_path_matches_the_normal_launch(monkeypatch):
    _require_fast_path()
    logits = make_logits(64, 151936, torch.bfloat16)
    ids = make_ids(64, 151936, ignore_every=5)
    inputs = _ratio_inputs(3000)
    ops = (logp_op._FWD, ratio_kl_op._FWD)
    with torch.no_grad(), contextlib.ExitStack() as host_paths_off:
        _op_calls(logits, ids, inputs)  # first calls: Triton's launch, direct launches stored
        host_paths_off.enter_context(logp_op._HOST.off())  # the direct launches, not the host path
        counters = {}
        for op in ops:
            counters[op] = counting = _CountingKernel(op.kernel)
            monkeypatch.setattr(op, "kernel", counting)
            keyed = op.launch_keyed

            def count_keyed(*args, _keyed=keyed, _counting=counting, **kwargs):
                _counting.calls += 1
                return _keyed(*args, **kwargs)

            monkeypatch.setattr(op, "launch_keyed", count_keyed)
        fast = _op_calls(logits, ids, inputs)  # direct launches only
        assert [counters[op].calls for op in ops] == [0, 0], "logp / ratio_kl: a repeat call missed its direct launch"
        assert launch.disabled_reason() is None
        for op in ops:
            monkeypatch.setattr(op, "_compiled", False)  # Triton's own launch from here on
        host_paths_off.enter_context(ratio_kl_op._HOST.off())  # and no host path (test_host_path_ratio_kl.py)
        normal = _op_calls(logits, ids, inputs)
    for i, (a, b) in enumerate(zip(fast, normal)):
        assert torch.equal(a, b), f"output {i} differs"


@pytest.mark.gpu
def test_ops_launch_keys_tell_apart_what_triton_specializes(monkeypatch):
    """Every call re-derives Triton's specialization and checks it against the op's key
    (RLK_VERIFY_LAUNCH_KEYS): a key too coarse for any of these cases raises LaunchKeyError."""
    _require_fast_path()
    monkeypatch.setattr(launch, "verify_keys", True)
    with torch.no_grad():
        for vocab, num_tokens in ((151936, 64), (32000, 17), (1000, 4)):
            logits = make_logits(num_tokens, vocab, torch.bfloat16, seed=vocab)
            ids = make_ids(num_tokens, vocab, ignore_every=3)
            for _ in range(2):
                _op_calls(logits, ids, _ratio_inputs(num_tokens * 40))
    assert launch.disabled_reason() is None


@pytest.mark.gpu
def test_launch_hooks_still_see_our_launches():
    if not triton.__version__.startswith(launch.VERIFIED_TRITON):
        pytest.skip(f"triton {triton.__version__}: the fast path is off for unverified versions")
    from triton import knobs

    logits, ids = make_logits(4, 1000, torch.float32), make_ids(4, 1000)
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    with torch.no_grad():
        logp_op.logp(logits, ids)  # compiled and cached
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            logp_op.logp(logits, ids)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        logp_op.logp(logits, ids)
    assert seen == ["_logp_fwd_kernel"]
