"""The real vime A/B runs of the benchmark matrix (one test per shipped vime spec).

They need a vime checkout with the kernel switches (`--rlk-vime-root`), the hardware and the
model checkpoints their markers name (`--rlk-model-root`, exported as RLK_MODELS), the datasets
(RLK_DATA) and Megatron-LM (MEGATRON_LM). Without them they skip with the reason. See
docs/e2e-vime.md.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.runner import run_ab
from pytest_rlk.e2e.spec import load_spec, matrix_spec_paths

_MARK = re.compile(r"^([a-z0-9_]+)(?:\((\d+)\))?$")


def _marks(markers: list[str]) -> list[pytest.MarkDecorator]:
    out = []
    for text in markers:
        name, arg = _MARK.match(text).groups()
        mark = getattr(pytest.mark, name)
        out.append(mark(int(arg)) if arg else mark)
    return out


def _cases():
    for path in matrix_spec_paths():
        spec = load_spec(path)
        if spec.engine == "vime":
            yield pytest.param(path, id=spec.case, marks=[pytest.mark.e2e, *_marks(spec.markers)])


def test_spec_markers_parse_into_pytest_marks():
    marks = _marks(["vime", "gpus(8)", "qwen3_30b_a3b"])
    assert [mk.name for mk in marks] == ["vime", "gpus", "qwen3_30b_a3b"] and marks[1].args == (8,)


@pytest.mark.parametrize("spec_path", list(_cases()))
def test_vime_ab(spec_path: Path, request, rlk_metrics, monkeypatch):
    vime_root = request.config.getoption("--rlk-vime-root")
    if vime_root is None:  # the plugin skips `vime` tests first; this guards direct use
        pytest.skip("needs a vime checkout: pass --rlk-vime-root")
    model_root = request.config.getoption("--rlk-model-root")
    if model_root:
        monkeypatch.setenv("RLK_MODELS", str(model_root))
    spec = load_spec(spec_path)
    run = run_ab(spec, rlk_metrics.artifact_dir / "ab",
                 options={"vime_root": str(vime_root), "mode": "ray", "ray_bin": os.environ.get("RLK_RAY_BIN", "ray")})
    rlk_metrics.set_case(spec.case)
    for (lane, role), outcome in run.arms.items():
        for name in (m.STEP_TIME, m.RAW_REWARD, m.ABS_DIFF):
            if name in outcome.series:
                policy = m.E2E_METRICS[name]
                rlk_metrics.record(f"{lane}.{role}.{name}", outcome.series[name], unit=policy.unit,
                                   direction=policy.direction, space=policy.space, gate=False,
                                   window={"skip": spec.window.skip_warmup_rollouts, "agg": policy.agg})
    assert run.passed, run.verdict.summary()
