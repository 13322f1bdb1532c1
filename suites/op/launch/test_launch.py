"""kernels.launch (Triton's launcher skipped on repeat calls), hit / miss / fallback with a recording
stand-in for Triton's launch: the first call launches normally, then the compiled kernel directly;
a misaligned tensor, another device, launch hooks, tracing, scratch, pre-run hooks and uncacheable
calls keep the normal launch; bad arguments reach Triton; an unexpected compiled kernel or an
unverified Triton disables the fast path loudly, once. Keyed launches (the ops' own keys): stored
with their constexprs, a key that merges two specializations refused, the verify mode, the native
launch's description and when it is withheld.

The key itself: test_launch_key.py; the ops' bad-input errors and the GPU's bitwise checks:
test_launch_ops.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from suites.op.rlk_op_cases import DEVICE
from kernels import launch
from kernels.launch import CachedLaunch
from kernels.ops import logp as logp_op
from suites.op.launch.stand_ins import Compiled, Normal, jit


# ---------------------------------------------------------------- hit / miss / fallback with stand-ins


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

    class WithScratch(Compiled):
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


class _Unloaded(Compiled):  # an internal API that moved: no loaded function after a launch
    def __init__(self):
        super().__init__()
        self.function = None


class _Moved(Compiled):  # the launcher became a plain callable: no .launch, no scratch sizes
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
    fast = jit()
    normal = Normal()
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


class _CompiledWithSource(Compiled):
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

    fast = jit(interleaved)
    normal = Normal()
    fast.kernel = normal
    x = torch.empty(8)
    for _ in range(2):
        fast.launch_keyed("k", (1,), x, 64, 8)
    assert fast.direct("k") is None
    assert len(normal.calls) == 1 and len(_launches(normal)) == 1  # the second call: a generic hit
