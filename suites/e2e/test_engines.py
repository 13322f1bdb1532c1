"""A third engine needs one folder: the test folder's fake engine (`fake_engine/`), registered by
name, runs through the same runner and CLI as vime and TRL (plan, run, progress, gates, report)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_engine import ENGINE as FAKE

from pytest_rlk.cli import main as rlk_main
from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.engines import engine_names, registered
from pytest_rlk.e2e.outcome import gate_arms, load_ab_run
from pytest_rlk.e2e.runner import plan_text, run_ab
from pytest_rlk.e2e.spec import SPECS_DIR, ABSpec, SpecError, load_spec
from pytest_rlk.schema import Verdict


def _fake_spec_path(tmp_path: Path, kernel_arm_env: dict[str, str] | None = None, **section: float) -> Path:
    raw = json.loads((SPECS_DIR / "trl-qwen3-tiny-dense-cpu.json").read_text())
    del raw["trl"]
    raw.update(engine="fake", case="fake-ab", fake=section)
    raw["arms"]["kernels"]["env"] = kernel_arm_env or {}
    path = tmp_path / "fake.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture
def fake_engine():
    with registered(FAKE) as engine:
        yield engine
    assert "fake" not in engine_names()


def test_a_registered_engine_plans_runs_gates_and_reports(fake_engine, tmp_path, capsys):
    path = _fake_spec_path(tmp_path, reward_slope=0.03)
    assert "fake" in engine_names() and load_spec(path).settings.reward_slope == 0.03
    assert rlk_main(["e2e", "plan", str(path)]) == 0
    plan = capsys.readouterr().out
    assert "arms differ only by the kernel switch" in plan and plan.count("arm.py --rollouts 16 --seed 1234") == 2
    out = tmp_path / "run"
    assert rlk_main(["e2e", "run", str(path), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "A/B fake-ab on cpu: PASS" in captured.out
    assert "[trl+kernels] rollout 16/16: raw_reward 0.55" in captured.err and "[trl] succeeded in" in captured.err
    report = (out / "report" / "report.md").read_text()
    assert FAKE.scope in report and "fake rows: 16" in report and "Pair verdict: PASS" in report
    verdict = gate_arms(load_ab_run(out))
    assert verdict.passed and {m.RAW_REWARD, m.ABS_DIFF, m.FALLBACK_COUNT} <= {c.name for c in verdict.gate.comparisons}


def test_rlk_report_takes_an_ab_directory(fake_engine, tmp_path, capsys):
    out = tmp_path / "run"
    assert rlk_main(["e2e", "run", str(_fake_spec_path(tmp_path)), "--out", str(out)]) == 0
    first = (out / "report" / "report.md").read_text()
    assert (out / "report" / "report.html").exists()  # beside the Markdown
    capsys.readouterr()
    assert rlk_main(["report", str(out), "-o", str(tmp_path / "again")]) == 0
    assert f"wrote {tmp_path / 'again' / 'report.md'} and {tmp_path / 'again' / 'report.html'}" in capsys.readouterr().out
    again = (tmp_path / "again" / "report.md").read_text()
    assert "**PASS**: pair verdict of fake-ab on cpu" in again
    assert again.split("## Metrics", 1)[1].split("## Reproduce", 1)[0] == first.split("## Metrics", 1)[1].split(
        "## Reproduce", 1)[0]  # the same arms, read back
    assert rlk_main(["report", str(out), "--no-plots"]) == 2
    assert "--no-plots: " in capsys.readouterr().err
    (out / "ab_result.json").unlink()  # as a run stopped before its end leaves it
    assert rlk_main(["report", str(out)]) == 2
    assert f"{out / 'ab_result.json'}: no A/B result" in capsys.readouterr().err


def test_a_kernel_arm_env_that_lowers_the_reward_fails_the_gate(fake_engine, tmp_path):
    spec = load_spec(_fake_spec_path(tmp_path, {"FAKE_REWARD_DROP": "0.2"}))
    assert "# declared environment of the kernels arm: FAKE_REWARD_DROP=0.2" in plan_text(spec)
    run = run_ab(spec, tmp_path / "run")
    assert not run.passed
    verdicts = {c.name: c.verdict for c in run.verdict.lanes[0].gate.comparisons}
    assert verdicts[m.RAW_REWARD] is Verdict.REGRESSION and verdicts[m.ABS_DIFF] is Verdict.PASS
    assert "Declared environment of the 'trl+kernels' arm" in run.report.markdown.read_text()


def test_the_engine_section_is_validated_by_the_engines_model(fake_engine, tmp_path):
    with pytest.raises(SpecError, match=r"fake\.reward_slope: Input should be greater than 0"):
        load_spec(_fake_spec_path(tmp_path, reward_slope=-1.0))
    assert rlk_main(["e2e", "plan", "trl-qwen3-tiny-dense-cpu", "--fake-python", "python3"]) == 2


def test_without_registration_the_engine_is_unknown(tmp_path):
    with pytest.raises(SpecError, match=r"engine: unknown engine 'fake' \(known: trl, vime\)"):
        load_spec(_fake_spec_path(tmp_path))
    raw = json.loads(_fake_spec_path(tmp_path).read_text())
    with pytest.raises(ValueError, match="unknown engine 'fake'"):
        ABSpec.model_validate(raw)
