"""The capacity search's CPU form with vime's own ``loss_function`` as the vime arm.

suites/module/test_capacity.py runs the CPU form without a vime checkout, where vime's path is the
labelled fp32 reference of its math. Here the same case (a tiny Qwen3 under the ``MemoryCap``
stand-in for the HBM limit) runs vime's real loss from ``--rlk-vime-root``, beside that reference and
``linear_logp``. vime's code holds less than the reference: it takes the log-probs per sample, on the
response rows of each (``get_responses``), so its fp32 temporaries are one sample's, not the
micro-batch's. Measured (2026-12-07, torch 2.13 CPU, cap 1.5 MiB): vime's own 88 tokens, the
reference 48, ``linear_logp`` 128. So the reference overstates what vime's path holds, and a gain
over it is not a gain over vime: the GPU benchmark (bench_capacity.py) takes ``--rlk-vime-root``
for that reason.
"""

from __future__ import annotations

import pytest
import torch

from pytest_rlk.extras import require_extra

pytestmark = pytest.mark.vime

CPU = torch.device("cpu")


def test_vimes_own_loss_in_the_cpu_capacity_form(vime_root, vime_loss, rlk_metrics):
    if torch.cuda.is_available():
        pytest.skip("the CPU form of the capacity search (a memory-cap stand-in for the HBM limit); this host "
                    "has a GPU: bench_capacity.py --rlk-vime-root measures the real limit here (-m bench_full)")
    require_extra("transformers")
    from suites.module import capacity_arms, capacity_run

    case = capacity_run.cpu_form_case()
    found = {}
    # vime's path with the checkout ("vime") and without it ("vime_reference"), then linear_logp
    for selector, root in ((capacity_arms.VIME_PATH, vime_root), (capacity_arms.VIME_PATH, None),
                           ("rlk_linear_logp", None)):
        arm = capacity_arms.arm_named(selector, root)
        found[arm.name] = capacity_run.run_arm(case, arm, CPU, out_dir=rlk_metrics.artifact_dir)
        capacity_run.record(rlk_metrics, found[arm.name], CPU, gate=False)
    largest = {name: f.search.largest for name, f in found.items()}
    for name, f in found.items():
        assert f.search.largest is not None and not f.search.bounded_by_limit, (name, f.search.probes)
    # the finding the module docstring states: vime's own code fits more than the reference of its math
    assert largest["vime"] > largest["vime_reference"], largest
    assert largest["rlk_linear_logp"] > largest["vime"], largest
    rlk_metrics.record("linear_logp_gain_over_vimes_own_loss", largest["rlk_linear_logp"] / largest["vime"],
                       direction="higher_is_better", space="ratio", gate=False)
