"""The fp32 references against hand-computed values of vime's formulas (absolute anchors)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference as ref
from kernels.reference import LossConfig


def test_selected_logprob_hand_value():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    ids = torch.tensor([2, -100])
    out = ref.selected_logprob(logits, ids, temperature=0.5)
    expected = 6.0 - math.log(math.exp(2.0) + math.exp(4.0) + math.exp(6.0))
    assert out.tolist() == pytest.approx([expected, 0.0], abs=1e-6)


def test_selected_logprob_grad_rule():
    logits = torch.randn(3, 11, requires_grad=True)
    ids = torch.tensor([0, 5, 10])
    ref.selected_logprob(logits, ids, temperature=0.7).sum().backward()
    softmax = torch.softmax(logits.detach() / 0.7, dim=-1)
    expected = (torch.nn.functional.one_hot(ids, 11).float() - softmax) / 0.7
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "kl_type, expected",
    [
        ("k1", lambda r: r),
        ("k2", lambda r: r * r / 2),
        ("k3", lambda r: math.exp(-r) - 1 + r),
        ("low_var_kl", lambda r: min(max(math.exp(-r) - 1 + r, -10.0), 10.0)),
    ],
)
def test_compute_kl_formulas(kl_type, expected):
    logp = torch.tensor([-1.0, -2.0, -20.0])
    base = torch.tensor([-1.5, -1.0, -3.0])
    r = (logp - base).tolist()
    out = ref.compute_kl(logp, base, kl_type)
    assert out.tolist() == pytest.approx([expected(x) for x in r], rel=1e-6)
    old = torch.tensor([-1.2, -2.5, -20.0])
    unbiased = ref.compute_kl(logp, base, kl_type, old_logp=old, use_unbiased_kl=True)
    weight = torch.exp(logp - old)
    torch.testing.assert_close(unbiased, out * weight)


def test_policy_loss_hand_values():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.5]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0])
    pg, clipfrac, ppo_kl = ref.policy_loss(logp, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    # ratio 1.5, A>0: clipped to 1.28 -> max(-1.5, -1.28) = -1.28, clipped
    # ratio 0.5, A<0: clipped to 0.8 -> max(0.5, 0.8) = 0.8, clipped
    # ratio 1.1 in range -> -2.2, not clipped; ratio 0.5, A>0 -> max(-0.5, -0.8) = -0.5, not clipped
    assert pg.tolist() == pytest.approx([-1.28, 0.8, -2.2, -0.5], rel=1e-6)
    assert clipfrac.tolist() == [1.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(ppo_kl, -logp)
    pg_dual, _, _ = ref.policy_loss(torch.log(torch.tensor([5.0])), torch.zeros(1), torch.tensor([-1.0]), eps_clip_c=3.0)
    assert pg_dual.tolist() == pytest.approx([3.0])  # min(-3 * -1, max(5, 0.8 * 1)) = 3


def test_tis_weights_clamp():
    old = torch.tensor([0.0, 0.0, 0.0])
    rollout = torch.tensor([1.0, -1.0, 0.0])
    assert ref.tis_weights(old, rollout).tolist() == pytest.approx([math.exp(-1), 2.0, 1.0])


def test_gspo_ratio_is_per_sample():
    logp = torch.tensor([-1.0, -2.0, -3.0, -1.0])
    old = torch.tensor([-1.5, -2.5, -3.0, -2.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    idx = ref.sample_index(torch.tensor([2, 2]))
    ratio = ref.gspo_sequence_ratio(logp, old, mask, idx, 2)
    assert ratio.tolist() == pytest.approx([math.exp(0.5)] * 2 + [math.exp(1.0)] * 2)


def test_sum_of_sample_mean_and_empty_sample():
    x = torch.tensor([1.0, 3.0, 100.0, 100.0, 2.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    lengths = torch.tensor([2, 2, 1])
    out = ref.sum_of_sample_mean(x, mask, lengths)
    assert float(out) == 2.0 + 0.0 + 2.0  # the all-masked sample contributes 0, not NaN
    assert float(ref.per_token_sum(x, mask)) == 6.0
    weights = ref.token_weights(mask, lengths, "sum_of_sample_mean")
    assert float((weights * x).sum()) == float(out)


def test_lengths_cu_seqlens_roundtrip():
    lengths = torch.tensor([3, 0, 5])
    cu = ref.lengths_to_cu_seqlens(lengths)
    assert cu.tolist() == [0, 3, 3, 8]
    assert ref.cu_seqlens_to_lengths(cu).tolist() == [3, 0, 5]
    assert ref.resolve_lengths(8, torch.device("cpu"), cu_seqlens=cu).tolist() == [3, 0, 5]
    assert ref.resolve_lengths(8, torch.device("cpu")).tolist() == [8]


def test_grpo_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    adv = ref.grpo_advantages(rewards, 3)
    std = torch.tensor([1.0, 0.0, 0.0]).std().item()  # unbiased (N - 1)
    assert adv[:3].tolist() == pytest.approx([(1 - 1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)])
    std2 = torch.tensor([1.0, 2.0, 2.0]).std().item()
    assert adv[3:].tolist() == pytest.approx([(-2 / 3) / (std2 + 1e-6), (1 / 3) / (std2 + 1e-6), (1 / 3) / (std2 + 1e-6)])
    raw = ref.grpo_advantages(rewards, 3, normalize_std=False)
    assert raw.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])
    assert ref.broadcast_to_tokens(raw[:2], torch.tensor([2, 1])).tolist() == pytest.approx([2 / 3, 2 / 3, -1 / 3])


def test_grpo_loss_reference_composes_the_pieces():
    """loss = reduce(pg) + coef * reduce(kl) with every piece recomputed by hand."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    ids = torch.randint(0, 50, (6,), generator=gen)
    logp = ref.selected_logprob(logits, ids)
    old = logp + 0.2 * torch.randn(6, generator=gen)
    base = logp + 0.3 * torch.randn(6, generator=gen)
    rollout = old + 0.1 * torch.randn(6, generator=gen)
    adv = torch.randn(6, generator=gen)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([3, 3])
    config = LossConfig(eps_clip=0.1, eps_clip_high=0.3, kl_loss_coef=0.2, kl_type="k3", use_tis=True)
    loss, metrics = ref.grpo_loss(
        logits, ids, old_logp=old, ref_logp=base, advantages=adv, loss_mask=mask, lengths=lengths,
        config=config, rollout_logp=rollout,
    )
    pg, clipfrac, ppo_kl = ref.policy_loss(logp, old, adv, 0.1, 0.3)
    pg = pg * ref.tis_weights(old, rollout)
    kl = ref.compute_kl(logp, base, "k3")

    def ssm(x):
        return sum((x[s:s + 3] * mask[s:s + 3]).sum() / mask[s:s + 3].sum() for s in (0, 3))

    assert float(loss) == pytest.approx(float(ssm(pg) + 0.2 * ssm(kl)), abs=1e-6)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(float(ssm(clipfrac)), abs=1e-6)
    assert float(metrics["ppo_kl"]) == pytest.approx(float(ssm(ppo_kl)), abs=1e-6)
    assert float(loss) != 0.0
