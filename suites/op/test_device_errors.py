"""Bad ids and packing found by the kernels: the error word, its report at a later call and at
``kernels.raise_pending_errors()``, the strict mode, and no host sync on the default path.

On CPU the contract checks CPU tensors on the host (no device queue to wait for); the kernels'
own checks run through the Triton interpreter with the deferral forced (``deferred`` fixture), so
every bad-input class is proved on the kernel side here too. On a GPU the deferral is the
default, and each op runs under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
from rlk_op_cases import DEVICE

import kernels
from kernels import LossConfig, device_errors
from kernels.contracts import checks

gpu_only = pytest.mark.gpu
CONFIG = LossConfig(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.01, kl_type="low_var_kl")
VOCAB = 64


@pytest.fixture
def deferred(monkeypatch):
    """Leave the value checks to the kernels on any device (on CPU: through the interpreter)."""
    monkeypatch.setattr(checks, "defer_value_check", lambda x: True)


def _logits(num_tokens=16, vocab=VOCAB, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(num_tokens, vocab, device=DEVICE, generator=gen).to(dtype)


def _ids(num_tokens=16, vocab=VOCAB):
    ids = torch.arange(num_tokens, device=DEVICE) % vocab
    ids[3] = -100  # ignore_index: allowed
    return ids


def _loss_inputs(num_tokens=16, **over):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    base = -torch.rand(num_tokens, device=DEVICE, generator=gen) * 3
    kw = {"old_logp": base + 0.1, "ref_logp": base - 0.1,
          "advantages": torch.randn(num_tokens, device=DEVICE, generator=gen),
          "loss_mask": torch.ones(num_tokens, dtype=torch.bool, device=DEVICE),
          "lengths": torch.tensor([4, 12], device=DEVICE)}
    kw.update(over)
    return kw


# every bad-input class of the value checks: (name, what to pass, the error on the host, on the device)
BAD_PACKING = {
    "negative_length": ({"lengths": torch.tensor([-4, 20])}, "lengths has negative entries", r"lengths\[0\] = -4"),
    "lengths_sum": ({"lengths": torch.tensor([4, 11])}, "lengths sum to 15 but there are 16", "lengths sum to 15"),
    "cu_seqlens_start": ({"lengths": None, "cu_seqlens": torch.tensor([1, 4, 16])}, "must start at 0",
                         r"cu_seqlens\[0\] = 1"),
    "cu_seqlens_end": ({"lengths": None, "cu_seqlens": torch.tensor([0, 4, 15])}, "end at T=16",
                       r"cu_seqlens\[2\] = 15"),
    "cu_seqlens_falls": ({"lengths": None, "cu_seqlens": torch.tensor([0, 9, 4, 16])}, "non-decreasing",
                         r"cu_seqlens\[2\] = 4"),
}


def _on_device(kw):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


# -- on the host: CPU tensors (always) and strict mode ------------------------------------------

@pytest.mark.parametrize("bad_id", [VOCAB, -1, 10**12])
def test_cpu_ids_out_of_range_raise_at_the_call(triton_strict, bad_id):
    if DEVICE != "cpu":
        pytest.skip("CPU tensors: checked on the host before the launch")
    ids = _ids()
    ids[5] = bad_id
    for op in (lambda: kernels.logp(_logits(), ids),
               lambda: kernels.grpo_loss(_logits(), ids, config=CONFIG, **_loss_inputs())):
        with pytest.raises(ValueError, match=r"target_ids has 1 id\(s\) outside \[0, 64\)"):
            op()


@pytest.mark.parametrize("case", BAD_PACKING)
def test_bad_packing_raises_on_the_host(triton_strict, monkeypatch, case):
    """CPU tensors, or strict mode on a GPU: the call itself raises, naming the input."""
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "strict")
    over, host_message, _ = BAD_PACKING[case]
    with pytest.raises(ValueError, match=host_message):
        kernels.grpo_loss(_logits(), _ids(), config=CONFIG, **_loss_inputs(**_on_device(over)))


def test_empty_lengths_raise_at_the_call(triton_strict):
    with pytest.raises(ValueError, match=r"lengths is empty \(B == 0\)"):
        kernels.grpo_loss(_logits(), _ids(), config=CONFIG,
                          **_loss_inputs(lengths=torch.zeros(0, dtype=torch.int64, device=DEVICE)))


def test_strict_mode_raises_at_the_call_on_any_device(triton_strict, monkeypatch):
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "strict")
    ids = _ids()
    ids[2] = VOCAB + 5
    with pytest.raises(ValueError, match=r"first: 69"):
        kernels.logp(_logits(), ids)
    assert not any(word.reported() for word in device_errors._words.values())


# -- on the device: the kernels' reports -----------------------------------------------------------

def _expect_report(match):
    with pytest.raises(device_errors.DeviceInputError, match=match) as info:
        kernels.raise_pending_errors()
    kernels.raise_pending_errors()  # reported once: the word is clear again
    return info.value


@pytest.mark.parametrize("op", ["logp", "logp_grad", "grpo_loss", "grpo_loss_two_read", "linear_logp"])
def test_kernels_report_a_bad_id(triton_strict, deferred, monkeypatch, op):
    ids = _ids()
    ids[5] = VOCAB + 7
    logits = _logits()
    if op == "logp":
        with torch.no_grad():
            out = kernels.logp(logits, ids)
        assert torch.isnan(out[5]) and bool(torch.isfinite(out[torch.arange(16, device=DEVICE) != 5]).all())
    elif op == "logp_grad":
        out = kernels.logp(logits.requires_grad_(), ids)
        assert torch.isnan(out[5])
    elif op.startswith("grpo_loss"):
        if op == "grpo_loss_two_read":
            monkeypatch.setenv("RLK_GRPO_ONE_READ", "0")
        loss, _ = kernels.grpo_loss(logits.requires_grad_(), ids, config=CONFIG, **_loss_inputs())
        assert torch.isnan(loss)
    else:
        hidden = torch.randn(16, 32, device=DEVICE)
        weight = torch.randn(VOCAB, 32, device=DEVICE)
        kernels.linear_logp(hidden, weight, ids)
    name = "grpo_loss" if op.startswith("grpo") else op.removesuffix("_grad")
    error = _expect_report(rf"kernels\.{name} call #\d+ \(logits \[16, 64\]\).*target_ids\[5\] = 71")
    assert (error.op, error.input) == (name, "target_ids") and error.call_id > 0


@pytest.mark.parametrize("case", BAD_PACKING)
def test_kernels_report_bad_packing(triton_strict, deferred, case):
    over, _, device_message = BAD_PACKING[case]
    kernels.grpo_loss(_logits(), _ids(), config=CONFIG, **_loss_inputs(**_on_device(over)))
    error = _expect_report(rf"kernels\.grpo_loss call #\d+.*{device_message}")
    assert error.input == ("cu_seqlens" if "cu_seqlens" in case else "lengths")


def test_a_report_raises_at_the_next_call_and_names_the_bad_one(triton_strict, deferred):
    ids = _ids()
    ids[0] = -7
    logits = _logits()
    with torch.no_grad():
        kernels.logp(logits, ids)
        bad_call = device_errors._next_id
        if DEVICE == "cuda":
            torch.cuda.synchronize()  # the report is written by now (a later call would find it anyway)
        with pytest.raises(device_errors.DeviceInputError, match=rf"call #{bad_call} .*target_ids\[0\] = -7"):
            kernels.logp(logits, _ids())  # a good call: raises the earlier call's report
        assert torch.isfinite(kernels.logp(logits, _ids())[torch.arange(16, device=DEVICE) != 3]).all()
    kernels.raise_pending_errors()


def test_good_calls_report_nothing(triton_strict, deferred):
    logits = _logits().requires_grad_()
    loss, _ = kernels.grpo_loss(logits, _ids(), config=CONFIG, **_loss_inputs())
    loss.backward()
    kernels.logp(logits, _ids()).sum().backward()
    kernels.raise_pending_errors()
    assert bool(torch.isfinite(logits.grad).all())


def test_raise_pending_errors_without_any_checked_call_is_a_no_op():
    kernels.raise_pending_errors()
    kernels.raise_pending_errors("cpu")


def test_reference_backend_checks_device_values_on_the_host(kernels_off, deferred):
    """A backend whose kernels do not check gets the host check before it runs."""
    ids = _ids()
    ids[1] = VOCAB
    with pytest.raises(ValueError, match=r"target_ids has 1 id\(s\) outside"):
        kernels.logp(_logits(), ids)


@pytest.mark.parametrize("g", [1.0, 8 / 256, 0.37, 2.5, 0.0, -0.0, -1.0, float("inf"), 1e-40])
def test_word_3_holds_the_last_gradient_and_reads_1_untouched(g):
    """Word 3 (not a report) holds grpo_loss's last incoming gradient as fp32 bits XOR bits(1.0):
    a fresh word reads 1.0, every fp32 value (signed zeros and subnormals too) comes back with its
    bits, and taking a report leaves it alone."""
    word = device_errors.ErrorWord(torch.device("cpu"))
    assert word.view[device_errors.LAST_GRAD] == 0 and word.last_grad() == 1.0
    fp32 = torch.tensor(g, dtype=torch.float32)
    word.view[device_errors.LAST_GRAD] = device_errors.encode_grad(g)
    assert torch.equal(torch.tensor(word.last_grad(), dtype=torch.float32).view(torch.int32), fp32.view(torch.int32))
    assert (word.view[device_errors.LAST_GRAD] == 0) == (g == 1.0)
    word.view[0], word.view[1], word.view[2] = 16 + device_errors.INPUT_TARGET_IDS, 5, 7
    assert word.take() is not None
    assert word.view[0] == 0 and word.last_grad() == fp32.item()


def test_check_mode_setting_parses(monkeypatch):
    from kernels import settings

    for raw, mode in (("strict", "strict"), ("STRICT", "strict"), ("1", "on"), ("off", "off"), ("", "on")):
        monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", raw)
        assert settings.CHECK_IDS.get() == mode
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "later")
    with pytest.raises(ValueError, match="VIME_RL_KERNEL_CHECK_IDS"):
        settings.CHECK_IDS.get()


# -- GPU: the default path waits for nothing ----------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ops_never_sync_the_host(triton_strict, dtype):
    """Every op, forward and backward, under sync debug mode "error": any host sync raises."""
    num_tokens, vocab = 512, 32000
    logits = _logits(num_tokens, vocab, dtype).requires_grad_()
    ids = torch.randint(0, vocab, (num_tokens,), device=DEVICE)
    ids[::7] = -100
    kw = _loss_inputs(num_tokens, lengths=torch.full((4,), num_tokens // 4, device=DEVICE))
    cu = torch.arange(0, num_tokens + 1, num_tokens // 4, device=DEVICE)
    hidden = torch.randn(num_tokens, 256, device=DEVICE, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, 256, device=DEVICE, dtype=dtype, requires_grad=True)
    logp_in = torch.randn(num_tokens, device=DEVICE, requires_grad=True)
    grad = torch.ones(num_tokens, device=DEVICE)

    def all_ops():
        with torch.no_grad():
            kernels.logp(logits, ids)
        torch.autograd.grad(kernels.logp(logits, ids), logits, grad)
        for one_read in ("1", "0"):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("RLK_GRPO_ONE_READ", one_read)
                loss, _ = kernels.grpo_loss(logits, ids, config=CONFIG, **kw)
                torch.autograd.grad(loss, logits)
        loss, _ = kernels.grpo_loss(logits, ids, config=CONFIG, **{**kw, "lengths": None, "cu_seqlens": cu})
        torch.autograd.grad(loss, logits)
        ratio, kl = kernels.ratio_kl(logp_in, kw["old_logp"], kw["ref_logp"], kw["loss_mask"])
        torch.autograd.grad((ratio + kl).sum(), logp_in)
        torch.autograd.grad(kernels.linear_logp(hidden, weight, ids).sum(), (hidden, weight))

    all_ops()  # compile, autotune, build outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        all_ops()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    kernels.raise_pending_errors()


@gpu_only
def test_a_bad_id_on_the_gpu_surfaces_at_raise_pending_errors(triton_strict):
    """The default path: the call returns without waiting; the report comes at the adapters' sync."""
    num_tokens, vocab = 256, 32000
    logits = _logits(num_tokens, vocab, torch.bfloat16).requires_grad_()
    ids = torch.randint(0, vocab, (num_tokens,), device=DEVICE)
    ids[17] = vocab
    kw = _loss_inputs(num_tokens, lengths=None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _ = kernels.grpo_loss(logits, ids, config=CONFIG, **kw)
        torch.autograd.grad(loss, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    error = _expect_report(r"kernels\.grpo_loss call #\d+ \(logits \[256, 32000\]\) on cuda:\d: "
                           r"target_ids has an id outside \[0, 32000\).*target_ids\[17\] = 32000")
    assert error.input == "target_ids"


@gpu_only
def test_cuda_without_an_index_is_the_current_devices_word():
    """A word is per device: ``cuda`` and ``cuda:<current>`` must name one word, or a report (and
    the last gradient) written through one would be missed through the other."""
    current = torch.device("cuda", torch.cuda.current_device())
    assert device_errors.word_for(torch.device("cuda")) is device_errors.word_for(current)
