"""The whole vime A/B path (commands, launcher, parser, gates, report) run against the STAND-IN
train.py (vime cannot run here), in the launcher's local mode: a pass, injected regressions, and a
run that dies midway."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_rlk.cli import main as rlk_main
from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.outcome import ABRunError
from pytest_rlk.e2e.runner import run_ab
from pytest_rlk.e2e.spec import SPECS_DIR, ABSpec, SpecError
from pytest_rlk.schema import Verdict


@pytest.fixture
def vime_root(tmp_path, monkeypatch, standin) -> Path:
    """A directory shaped like a vime checkout: the stand-in as train.py, a model-args script."""
    root = tmp_path / "vime"
    (root / "scripts" / "models").mkdir(parents=True)
    (root / "train.py").write_text(standin.read_text())
    (root / "scripts" / "models" / "qwen3-0.6B.sh").write_text("MODEL_ARGS=(--num-layers 28 --hidden-size 1024)\n")
    for var in ("RLK_MODELS", "RLK_DATA", "MEGATRON_LM"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    return root


def _spec(lanes: tuple[str, ...] = ("replay", "live"), **switch_env: str) -> ABSpec:
    raw = json.loads((SPECS_DIR / "qwen3-0.6b-2gpu-smoke-gsm8k.json").read_text())
    raw["lanes"] = list(lanes)
    raw["hardware"]["platform"] = "cpu"
    raw["timeouts"]["job_s"] = 60
    raw["kernel_switch"]["env"].update(switch_env)
    return ABSpec.model_validate(raw)


def _run(spec: ABSpec, root: Path, out: Path):
    return run_ab(spec, out, options={"vime_root": str(root), "mode": "local", "python": sys.executable})


def test_standin_ab_passes_both_lanes_and_reports(vime_root, tmp_path):
    out = tmp_path / "run"
    run = _run(_spec(), vime_root, out)
    assert run.passed, run.verdict.summary()
    assert [lane.lane for lane in run.verdict.lanes] == ["replay", "live"]
    # the replay lane's kernel arm trained on the baseline's recorded rollouts
    assert sorted(p.name for p in (out / "replay" / "rollouts").iterdir())[0] == "rollout_0.pt"
    kern_log = (out / "replay" / "kernels" / "arm.log").read_text()
    assert "--load-debug-rollout-data" in kern_log and "--num-layers 28" not in kern_log.splitlines()[1]
    saved = json.loads((out / "live" / "kernels" / "series.json").read_text())
    assert saved["series"][m.FALLBACK_COUNT] == [0.0] * 6 and saved["status"] == "succeeded"
    report = run.report.markdown.read_text()
    assert "Pair verdict: PASS" in report and "kernels.integrations.vime.policy_loss" in report
    assert json.loads((out / "ab_result.json").read_text())["passed"] is True
    assert "no TensorBoard events under" in report  # the stand-in writes none: said, not hidden


def test_tensorboard_disagreeing_with_stdout_fails_the_lane(vime_root, tmp_path, fixtures_dir):
    spec = _spec(("live",), RLK_STANDIN_TB_EVENTS=str(fixtures_dir / "vime_tb.tfevents.fixture"))
    run = _run(spec, vime_root, tmp_path / "run")
    failures = "\n".join(run.verdict.lanes[0].failures())
    assert not run.passed and "metric sources disagree: rollout/raw_reward at 0" in failures


def test_injected_regressions_fail_the_live_lane(vime_root, tmp_path):
    injected = {"RLK_STANDIN_REWARD_DROP": "0.3", "RLK_STANDIN_ABSDIFF_RISE": "0.05", "RLK_STANDIN_FALLBACKS": "2"}
    run = _run(_spec(("live",), **injected), vime_root, tmp_path / "run")
    verdicts = {c.name: c.verdict for c in run.verdict.lanes[0].gate.comparisons}
    for metric in (m.RAW_REWARD, m.ABS_DIFF, m.FALLBACK_COUNT):
        assert verdicts[metric] is Verdict.REGRESSION, metric
    assert not run.passed and "FAIL" in run.verdict.summary()


def test_run_dying_midway_keeps_artifacts_and_fails_clearly(vime_root, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ABRunError) as info:
        _run(_spec(RLK_STANDIN_DIE_AT_ROLLOUT="2", RLK_STANDIN_MALFORMED="1"), vime_root, out)
    message = str(info.value)
    assert "exit code 17" in message and "dying midway" in message and str(out / "replay" / "kernels" / "arm.log") in message
    run = info.value.run
    assert not run.passed
    partial = json.loads((out / "replay" / "kernels" / "series.json").read_text())
    assert partial["status"] == "failed" and len(partial["series"][m.RAW_REWARD]) == 3
    assert partial["info"]["unreadable_lines"]["count"] == 6
    assert len(partial["info"]["unreadable_lines"]["first"]) == 3
    result = json.loads((out / "ab_result.json").read_text())
    assert result["unreadable_lines"]["replay/kernels"]["count"] == 6
    assert "Unreadable vime log lines:" in run.report.markdown.read_text()
    assert run.report.markdown.exists() and "failed" in run.report.markdown.read_text()


def test_cli_run_and_exit_codes(vime_root, tmp_path, capsys):
    spec_path = tmp_path / "smoke.json"
    spec_path.write_text(_spec(("live",)).model_dump_json())
    args = ["e2e", "run", str(spec_path), "--vime-root", str(vime_root), "--mode", "local",
            "--python", sys.executable, "--out", str(tmp_path / "cli")]
    assert rlk_main(args) == 0
    captured = capsys.readouterr()
    assert "PASS" in captured.out
    # progress on the terminal while the arms run (stderr; the arms' full output is in arm.log)
    for line in (f"[vime] started (live lane), log {tmp_path / 'cli' / 'live' / 'baseline' / 'arm.log'}",
                 "[vime+kernels] rollout 1/6: raw_reward 0.2", "[vime+kernels] rollout 6/6: raw_reward 0.4"):
        assert line in captured.err, line
    assert "[vime] succeeded in " in captured.err and "[vime+kernels] succeeded in " in captured.err
    spec_path.write_text(_spec(("live",), RLK_STANDIN_REWARD_DROP="0.3").model_dump_json())
    assert rlk_main(args) == 2  # --out holds the first run: never overwritten unasked
    assert f"--out {tmp_path / 'cli'}: not empty (an earlier run?); pass --overwrite" in capsys.readouterr().err
    assert rlk_main([*args, "--overwrite"]) == 1
    assert json.loads((tmp_path / "cli" / "ab_result.json").read_text())["passed"] is False
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a run")
    assert rlk_main([*args[:-1], str(tmp_path / "mine"), "--overwrite"]) == 2
    assert "not an earlier `rlk e2e run` output (no spec.json)" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").exists()
    assert rlk_main(["e2e", "run", str(spec_path), "--vime-root", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert rlk_main(["e2e", "run", str(spec_path)]) == 2
    assert "engine 'vime' needs --vime-root" in capsys.readouterr().err


def test_pinned_vime_commit_must_match_the_checkout(vime_root, tmp_path):
    git = ["git", "-C", str(vime_root), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "stand-in checkout"]):
        subprocess.run(git + args, check=True, capture_output=True)
    raw = json.loads(_spec(("live",)).model_dump_json())
    raw["vime"]["commit"] = "0123456789abcdef"
    with pytest.raises(SpecError, match=r"pins vime commit 0123456789abcdef but .* is at [0-9a-f]{40}"):
        _run(ABSpec.model_validate(raw), vime_root, tmp_path / "run")
