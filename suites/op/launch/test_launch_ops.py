"""The ops under kernels.launch and the host-time-trimmed validation: the ops' bad-input errors
called directly (not through the public API's pre-checks), the finite check following the
environment at every call; on a GPU, the fast path gives bitwise the results of
``kernel[grid](...)`` across dtype and alignment changes and never reuses a kernel compiled for
other arguments, and launch hooks still see our launches."""

from __future__ import annotations

import contextlib

import pytest
import torch
import triton

from kernels import device_errors, launch
from kernels.contracts import checks
from kernels.launch import CachedLaunch
from kernels.ops import logp as logp_op
from kernels.ops import ratio_kl as ratio_kl_op
from suites.op.rlk_op_cases import DEVICE, make_ids, make_logits


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
