"""The drift ladder's fixtures: one ladder per drift model, computed once per session."""

from __future__ import annotations

import logging

import pytest
import torch

from pytest_rlk.drift import rungs
from pytest_rlk.drift.result import LadderResult
from pytest_rlk.drift.runner import run_ladder


def ladder_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def ladders(drift_cases):
    """``ladders(kind)``: the default ladder (every rung) on the drift model ``kind``, computed on
    first use and shared by the session's tests."""
    cache: dict[str, LadderResult] = {}

    def get(kind: str) -> LadderResult:
        if kind not in cache:
            case = drift_cases[kind]
            cache[kind] = run_ladder(case.model_dir, case.batch, rungs.default_ladder(), device=ladder_device(),
                                     label=f"tiny-{kind}", rollout_unavailable=case.rollout_unavailable,
                                     progress=logging.getLogger("rlk.drift").info)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def mismatch_rollouts(tmp_path_factory):
    """The semantics rung's and the precision matrix's rollouts (suites/module/drift/mismatch_cases.py):
    one vLLM child, two engine loads, shared by their tests; skipped without vLLM (both measure the
    engine's own log-probs)."""
    from pytest_rlk.drift.rollout import RolloutError, vllm_missing_reason
    from suites.module.drift import mismatch_cases

    reason = vllm_missing_reason()
    if reason:
        pytest.skip(reason)
    try:
        return mismatch_cases.roll_out(tmp_path_factory.mktemp("mismatch-rollouts"))
    except RolloutError as exc:
        pytest.fail(str(exc), pytrace=False)
