"""``rlk drift`` / ``python -m pytest_rlk.drift`` on a model directory a user names.

One real child process (the module entry point, as a user runs it: progress lines, the table, the
files); the error paths run in-process through the same ``main``. No vLLM here (``--no-rollout``):
the rollout path is the session's shared one (test_drift_ladder.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_rlk.drift import cli
from pytest_rlk.e2e.processes import pythonpath_first
from suites.module import tiny

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli")
    (out / "prompts.json").write_text(json.dumps(tiny.drift_prompts(2)))
    return tiny.save_model_dir("dense", out / "dense", seed=11, lm_head_std=tiny.TRAINED_LIKE_LM_HEAD_STD)


@pytest.mark.tiny
def test_drift_command_writes_table_plot_and_json(model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIME_RL_KERNEL")}
    env["PYTHONPATH"] = pythonpath_first(ROOT, environ=env)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pytest_rlk.drift", str(model_dir), "--no-rollout", "--rungs", "A0,A1,A3,A5",
           "--prompts", str(model_dir.parent / "prompts.json"), "--n", "2", "--max-tokens", "8",
           "--temperature", "0.7", "--device", "auto", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("[rlk drift") and "side 1/" in line for line in lines), proc.stdout[-2000:]
    assert any("A5 skipped: --no-rollout" in line for line in lines)
    text = (out / "drift.md").read_text()
    for row in ("| A0 | twice |", "| A1 | kernels |", "| A1 | liger |", "| A3 | bf16 |"):
        assert row in text
    assert "| A2 |" not in text and "skipped: --no-rollout" in text
    assert "sampled by hf-generate; sampling temperature 0.7" in text
    assert "A5 did not run here (--no-rollout)" in text
    (result,) = json.loads((out / "drift.json").read_text())
    assert result["preconditions"]["temperature"] == 0.7 and result["active_tokens"] == 2 * 2 * 8
    assert (out / "drift.png").is_file()


def test_unknown_model_is_named(tmp_path, capsys):
    assert cli.main([str(tmp_path / "nope"), "--model-root", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"model '{tmp_path / 'nope'}': no HF model directory" in err and str(tmp_path / "nope") in err


@pytest.mark.parametrize("option", ["--model-root", "--rlk-model-root"])
def test_a_model_name_is_found_under_the_model_root(tmp_path, option):
    """The plugin's checkpoint layout: a marker name (qwen3_4b) or its HF directory name (Qwen3-4B)."""
    (tmp_path / "Qwen3-4B").mkdir()
    (tmp_path / "Qwen3-4B" / "config.json").write_text("{}")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["qwen3_4b", option, str(tmp_path)])
    assert cli.resolve_model(args.models[0], args.model_root) == (tmp_path / "Qwen3-4B").resolve()


def test_model_with_its_own_code_needs_the_flag(tmp_path, capsys):
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({
        "model_type": "rlk_custom_model", "architectures": ["RlkModel"],
        "auto_map": {"AutoConfig": "configuration_rlk.RlkConfig", "AutoModelForCausalLM": "modeling_rlk.RlkModel"}}))
    assert cli.main([str(remote), "--no-rollout", "--out", str(tmp_path / "o")]) == 2
    assert "needs its own code (trust_remote_code); pass --trust-remote-code" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--rungs", "A1,Z9"], "unknown rung(s) ['Z9']"),
    (["--temperature", "0"], "temperature 0.0: must be > 0"),
])
def test_bad_options_are_named(model_dir, tmp_path, capsys, args, message):
    assert cli.main([str(model_dir), "--no-rollout", "--out", str(tmp_path / "o"), *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_prompts_file_is_named(model_dir, tmp_path, capsys):
    bad = tmp_path / "prompts.json"
    bad.write_text(json.dumps([[1, 2], {"text": "x"}]))
    assert cli.main([str(model_dir), "--no-rollout", "--prompts", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "prompt 1: {'text': 'x'} is neither a string nor a list of token ids" in capsys.readouterr().err


def test_rlk_lists_the_drift_command(capsys):
    from pytest_rlk.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["drift", "--help"])
    assert "--trust-remote-code" in capsys.readouterr().out
