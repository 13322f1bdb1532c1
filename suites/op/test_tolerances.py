"""The tolerance table: complete, sourced, no looser than the ops' acceptance bounds, mirrored in
docs/tolerances.md, and its ulp comparison counts ulps correctly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import tolerances

DOC = Path(__file__).resolve().parents[2] / "docs" / "tolerances.md"


def test_docs_mirror_the_table():
    assert DOC.read_text() == tolerances.render_markdown(), "run: python -m kernels.tolerances > docs/tolerances.md"


def test_every_entry_has_a_source_and_both_platforms():
    keys = {(check, dtype) for check, dtype, _ in tolerances.TABLE}
    for check, dtype in keys:
        for platform in tolerances.PLATFORMS:
            assert tolerances.TABLE[(check, dtype, platform)].source


@pytest.mark.parametrize(
    "check, dtype, atol_max",
    [("logp", "fp32", 1e-5), ("grpo_loss", "fp32", 1e-5), ("logp.grad", "fp32", 1e-6), ("grpo_loss.grad", "fp32", 1e-6),
     ("logp", "bf16", 1e-4), ("logp", "fp16", 1e-4), ("logp.tp2", "fp32", 1e-5)],
)
def test_no_looser_than_the_acceptance_bounds(check, dtype, atol_max):
    for platform in tolerances.PLATFORMS:
        assert tolerances.get(check, dtype, platform).atol <= atol_max


@pytest.mark.parametrize("check", ["logp.grad", "grpo_loss.grad"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16bit_gradients_within_one_ulp(check, dtype):
    assert tolerances.get(check, dtype, "gpu").ulp == 1


def test_ulp_comparison():
    tol = tolerances.Tolerance(0.0, ulp=1, source="test")
    expected = torch.tensor([1.0, 0.3, -2.5, 0.0])
    spacing = tolerances.spacing(expected.to(torch.bfloat16).float(), torch.bfloat16)
    assert spacing[0] == 2**-7 and spacing[2] == 2**-6
    one_off = expected.to(torch.bfloat16).float() + spacing
    assert tolerances.closeness(one_off.to(torch.bfloat16), expected, tol).ok
    two_off = expected.to(torch.bfloat16).float() + 2 * spacing
    result = tolerances.closeness(two_off.to(torch.bfloat16), expected, tol)
    assert not result.ok and result.max_ulp_err == pytest.approx(2.0)


def test_nonfinite_actual_fails():
    tol = tolerances.get("logp", "fp32", "cpu")
    assert not tolerances.closeness(torch.tensor([float("nan")]), torch.tensor([0.0]), tol).ok


def test_assert_close_message_names_input_and_source():
    with pytest.raises(AssertionError, match=r"dlogits \(fp32, cpu\).*exceeds atol 1e-06 \[acceptance bound of the logits ops\]"):
        tolerances.assert_close(torch.tensor([1.0]), torch.tensor([1.1]), "logp.grad", torch.float32, "cpu", name="dlogits")


def test_upstream_gradient_scales_gradient_atol_only():
    base = tolerances.get("logp.grad", "fp32", "gpu")
    g = torch.tensor([0.5, -3.0, 2.0])
    assert tolerances.get("logp.grad", "fp32", "gpu", upstream=g).atol == pytest.approx(3.0 * base.atol)
    assert tolerances.get("logp.grad", "fp32", "gpu", upstream=0.25).atol == base.atol  # max(1, .) never tightens
    assert tolerances.get("logp.grad", "bf16", "gpu", upstream=g).ulp == 1  # ulp: relative, unscaled
    with pytest.raises(ValueError, match="gradient checks only"):
        tolerances.get("logp", "fp32", "gpu", upstream=g)
    # an error of 2.5e-6 under an upstream gradient of magnitude 3 passes; under 1 it does not
    expected, actual = torch.tensor([-1.6]), torch.tensor([-1.6 + 2.5e-6])
    tolerances.assert_close(actual, expected, "logp.grad", torch.float32, "gpu", upstream=g)
    with pytest.raises(AssertionError):
        tolerances.assert_close(actual, expected, "logp.grad", torch.float32, "gpu")


def test_summed_terms_scale_value_atol_by_sqrt():
    base = tolerances.get("grpo_loss", "fp32", "gpu")
    assert tolerances.get("grpo_loss", "fp32", "gpu", terms=3072).atol == pytest.approx(base.atol * 3072**0.5)
    assert tolerances.get("grpo_loss", "fp32", "gpu", terms=0).atol == base.atol
    with pytest.raises(ValueError, match="value checks only"):
        tolerances.get("grpo_loss.grad", "fp32", "gpu", terms=10)


def test_loss_gradient_atol_adds_the_logp_error_carried_by_its_upstream_gradient():
    grad, logp = tolerances.get("grpo_loss.grad", "fp32", "gpu"), tolerances.get("logp", "fp32", "gpu")
    assert tolerances.get("grpo_loss.grad", "fp32", "gpu", upstream=9.0).atol == pytest.approx(9 * (grad.atol + logp.atol))
    assert tolerances.get("grpo_loss.grad", "fp32", "gpu", upstream=0.1).atol == pytest.approx(grad.atol + 0.1 * logp.atol)
    assert tolerances.get("grpo_loss.grad", "bf16", "gpu", upstream=9.0).ulp == 1


def test_tolerance_band_bounds_a_max_error_by_the_table():
    """The band an A/B of two backends' errors uses (rlk_op_cases.tolerance_band): the tolerance
    at the largest reference magnitude, named with its table entry."""
    from rlk_op_cases import PLATFORM, tolerance_band

    from pytest_rlk.compare import compare_value
    from pytest_rlk.schema import Band

    ref = torch.tensor([-0.5, 10.0])
    band = tolerance_band("grpo_loss", torch.float32, tolerances.get("grpo_loss", torch.float32), ref)
    assert band["abs_floor"] == pytest.approx(1e-5 + 1e-6 * 10.0)
    assert band["source"].startswith(f"kernels.tolerances (grpo_loss, fp32, {PLATFORM}): atol 1e-05, rtol 1e-06")
    grad = tolerance_band("logp.grad", torch.bfloat16, tolerances.get("logp.grad", torch.bfloat16),
                          torch.tensor([0.75, -0.1]))
    assert grad["abs_floor"] == pytest.approx(2.0 ** -8)  # one bf16 ulp at 0.75
    logp = tolerance_band("logp", torch.bfloat16, tolerances.get("logp", torch.bfloat16), torch.tensor([-3.0]))
    verdict = compare_value("logp_max_abs_err", 0.0, 1.9e-6, direction="lower_is_better", band=Band(**logp))
    assert verdict.verdict.value == "pass"  # within atol 1e-4: no regression from an exact 0
