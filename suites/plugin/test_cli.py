"""`rlk diff` exit codes (clean run, injected regression, A/B pair) through the real entry point."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rlk_plugin_testing import checkout_pythonpath, latest_run_dir

from pytest_rlk import cli

GATED = """
import os

def test_gated(rlk_metrics):
    rlk_metrics.record("loss", float(os.environ.get("RLK_LOSS", "1.0")), direction="lower_is_better",
                       space="loss")
    rlk_metrics.record("tokens_per_s", 1000.0, direction="higher_is_better", space="throughput")
"""


def rlk(*args: str, cwd) -> subprocess.CompletedProcess:
    """The console entry as a user runs it (`rlk ...` is `python -m pytest_rlk.cli ...`)."""
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(os.environ.get("PYTHONPATH"))}
    return subprocess.run([sys.executable, "-m", "pytest_rlk.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def two_runs(rlk_pytester, monkeypatch):
    """A clean run (with its baselines recorded) and a run with the loss regressed by 5%."""
    rlk_pytester.makepyfile(**{"suites/op/test_gated": GATED})
    monkeypatch.setenv("RLK_LOSS", "1.0")
    rlk_pytester.runpytest("--rlk-update-baselines=all").assert_outcomes(passed=1)
    clean = latest_run_dir(rlk_pytester)
    monkeypatch.setenv("RLK_LOSS", "1.05")
    rlk_pytester.runpytest().assert_outcomes(failed=1)
    regressed = latest_run_dir(rlk_pytester)
    return rlk_pytester, clean, regressed


def test_diff_clean_run_exits_0(two_runs):
    pytester, clean, _ = two_runs
    done = rlk("diff", str(clean), "--baselines", "baselines", cwd=pytester.path)
    assert done.returncode == 0, done.stderr
    header = done.stdout.splitlines()[1].split()
    assert header == ["metric", "baseline", "new", "delta", "band", "verdict"]
    lines = done.stdout.splitlines()
    assert lines[3] == "test_gated.test_gated"  # the case, then its metrics indented under it
    assert lines[4].split()[0] == "loss" and lines[4].startswith("  ") and "2 pass" in done.stdout
    wide = rlk("diff", str(clean), "--baselines", "baselines", "--wide", cwd=pytester.path)
    assert "test_gated.test_gated/loss" in wide.stdout


def test_diff_regression_exits_1(two_runs):
    pytester, _, regressed = two_runs
    done = rlk("diff", str(regressed / "run.json"), "--baselines", "baselines", cwd=pytester.path)
    assert done.returncode == 1
    loss_row = next(line for line in done.stdout.splitlines() if line.split()[:1] == ["loss"])
    assert loss_row.split()[1:] == ["1", "1.05", "0.05", "0.01", "regression"]


def test_diff_latest_is_the_newest_run(two_runs):
    pytester, _, _ = two_runs
    assert cli.main(["--artifacts", str(pytester.path / ".rlk/runs"), "diff", "latest",
                     "--baselines", str(pytester.path / "baselines")]) == 1


def test_diff_ab_pair(two_runs, capsys):
    _, clean, regressed = two_runs
    assert cli.main(["diff", str(clean), str(clean)]) == 0
    assert cli.main(["diff", str(clean), str(regressed)]) == 1
    assert "regression" in capsys.readouterr().out
    assert cli.main(["diff", str(regressed), str(clean)]) == 0  # B better: flagged, not failed
    assert "improved: better than the reference beyond the refresh band (refresh the baseline)" \
        in capsys.readouterr().out
    assert cli.main(["diff", str(regressed), str(clean), "--fail-on-improvement"]) == 1


def test_diff_corrupt_or_missing_run_exits_2(two_runs):
    pytester, clean, _ = two_runs
    data = json.loads((clean / "run.json").read_text())
    data["status"] = "finished-ish"
    (clean / "run.json").write_text(json.dumps(data))
    done = rlk("diff", str(clean), cwd=pytester.path)
    assert done.returncode == 2
    assert "run.json: field 'status'" in done.stderr
    assert rlk("diff", str(pytester.path / "nope"), cwd=pytester.path).returncode == 2
    assert rlk("diff", cwd=pytester.path).returncode == 2  # usage error (argparse)


def test_extension_subcommands_are_added(monkeypatch, capsys):
    """A stand-in extension module registers a command the way pytest_rlk.e2e.cli does."""
    import types

    ext = types.ModuleType("pytest_rlk.bench_cli")

    def add_subcommands(subparsers):
        hello = subparsers.add_parser("hello")
        hello.add_argument("--code", type=int, default=0)
        hello.set_defaults(func=lambda args: print("hello from ext") or args.code)

    ext.add_subcommands = add_subcommands
    monkeypatch.setitem(sys.modules, "pytest_rlk.bench_cli", ext)
    assert cli.main(["hello", "--code", "3"]) == 3
    assert "hello from ext" in capsys.readouterr().out


def test_broken_extension_warns_and_builtins_still_work(monkeypatch, capsys, tmp_path):
    import pytest_rlk

    (tmp_path / "bench_cli.py").write_text("import a_module_that_does_not_exist_here\n")
    monkeypatch.setattr(pytest_rlk, "__path__", [*pytest_rlk.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "pytest_rlk.bench_cli", raising=False)
    assert cli.main(["merge", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "warning: subcommands of pytest_rlk.bench_cli not loaded" in err
    assert "a_module_that_does_not_exist_here" in err
    assert "none" in err  # the merge error names the missing run


def test_run_ids_are_accepted_wherever_a_run_is(two_runs):
    """The id the summary and the report show (the run directory's name), resolved under the
    default artifacts directory (.rlk/runs here or in a parent) or --artifacts."""
    pytester, clean, regressed = two_runs
    sub = pytester.path / "suites"
    assert rlk("diff", clean.name, "--baselines", "../baselines", cwd=sub).returncode == 0
    assert rlk("diff", regressed.name, "--baselines", "../baselines", cwd=sub).returncode == 1
    assert rlk("diff", clean.name, regressed.name, cwd=sub).returncode == 1
    assert rlk("merge", clean.name, cwd=sub).returncode == 0
    done = rlk("report", regressed.name, "--no-plots", cwd=sub)
    assert done.returncode == 0, done.stderr
    assert (regressed / "report" / "report.md").exists()
    elsewhere = rlk("--artifacts", str(pytester.path / ".rlk/runs"), "diff", clean.name,
                    "--baselines", "baselines", cwd=pytester.path)
    assert elsewhere.returncode == 0
    typo = rlk("diff", clean.name[:-1] + "x", cwd=pytester.path)
    assert typo.returncode == 2
    assert "not a run directory, run.json file or run id under " in typo.stderr
    assert clean.name in typo.stderr and regressed.name in typo.stderr


LONG_NAMES = """
import pytest

@pytest.mark.parametrize("variant", ["gspo-temp-unbiased-k2-reference", "dualclip-nokl-kernels"])
def test_custom_loss_matches_vime_math_with_a_long_name(rlk_metrics, variant):
    for name in ("kernels_train_rollout_logprob_abs_diff", "dlogits_logp_kernels_vs_megatron", "loss_abs_err"):
        rlk_metrics.record(name, 1.23456789e-7, direction="lower_is_better", space="error",
                           band={"abs_floor": 1e-5, "source": "the test's tolerance " + "(where it comes from) " * 8})
"""


def test_diff_table_fits_120_columns_and_says_how_to_record_missing_baselines(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/module/test_long_names_of_a_module_suite": LONG_NAMES})
    rlk_pytester.runpytest("--rlk-tier=module", "--rlk-platform=cpu").assert_outcomes(passed=2)
    missing = rlk("diff", "latest", cwd=rlk_pytester.path)
    assert missing.returncode == 0
    hint, command = missing.stdout.splitlines()[-2:]
    assert hint == "no baseline for 2 cases under baselines/module/cpu/; record them with:"
    # the run's own command line (pytester adds its --basetemp) with --rlk-update-baselines=failed
    assert command.startswith("  pytest --rlk-tier=module --rlk-platform=cpu ")
    assert command.endswith(" --rlk-update-baselines=failed")
    recording = rlk_pytester.runpytest("--rlk-tier=module", "--rlk-platform=cpu", "--rlk-update-baselines=failed")
    recording.stdout.fnmatch_lines(["baselines written: 2"])
    assert "record them with" not in recording.stdout.str()  # it just did
    rlk_pytester.runpytest("--rlk-tier=module", "--rlk-platform=cpu").assert_outcomes(passed=2)
    done = rlk("diff", "latest", cwd=rlk_pytester.path)
    assert done.returncode == 0 and "6 pass" in done.stdout
    lines = done.stdout.splitlines()[1:]
    assert max(len(line) for line in lines) <= 120, done.stdout  # a case name is never split
    notes = lines[lines.index(next(line for line in lines if line.startswith("band source:"))):]
    assert len(notes) > 2 and max(len(line) for line in notes) <= 100, done.stdout  # notes wrap


MANY_CASES = """
import os
import pytest

@pytest.mark.parametrize("i", [int(i) for i in os.environ["RLK_CASES"].split(",")])
def test_case(rlk_metrics, i):
    rlk_metrics.record("loss", 1.0, direction="lower_is_better", space="loss")

def test_ungated(rlk_metrics):
    rlk_metrics.record("note", 1.0, direction="two_sided", gate=False)
"""


def test_ab_diff_of_runs_with_different_tests_lists_the_one_run_cases_under_one_heading(rlk_pytester, capsys,
                                                                                         monkeypatch):
    rlk_pytester.makepyfile(**{"suites/op/test_many": MANY_CASES})
    monkeypatch.setenv("RLK_CASES", "0,1,2,3,4")
    rlk_pytester.runpytest().assert_outcomes(passed=6)
    a = str(latest_run_dir(rlk_pytester))
    monkeypatch.setenv("RLK_CASES", "0,5")
    rlk_pytester.runpytest().assert_outcomes(passed=3)
    b = str(latest_run_dir(rlk_pytester))
    capsys.readouterr()
    assert cli.main(["diff", a, b]) == 0  # what both ran passes; the rest is listed, not failed
    lines = capsys.readouterr().out.splitlines()
    heading = lines.index("cases in one run only (not compared): 5 (4 in A only, 1 in B only)")
    assert lines[heading + 1:heading + 4] == [
        "  A only (4): test_many.test_case-1, test_many.test_case-2, test_many.test_case-3,",
        "      test_many.test_case-4",
        "  B only (1): test_many.test_case-5"]
    table = lines[:heading]  # the ungated case (nothing to compare) has no line
    assert [line for line in table if line.startswith("test_many.")] == ["test_many.test_case-0"]
    assert "1 pass" in lines


def test_the_command_line_and_a_diff_never_import_torch(rlk_pytester):
    """torch takes seconds to import on a GPU host (its CUDA libraries); ``rlk`` builds its parser,
    every extension's included, and diffs a run without it."""
    rlk_pytester.makepyfile(**{"suites/op/test_gated": GATED})
    assert rlk_pytester.runpytest("-p", "no:cacheprovider").ret == 0
    run = latest_run_dir(rlk_pytester)
    probe = ("import sys, runpy; sys.argv = ['rlk', 'diff', sys.argv[1]]\n"
             "try:\n    runpy.run_module('pytest_rlk.cli', run_name='__main__')\n"
             "except SystemExit as done:\n    code = done.code\n"
             "print('torch imported' if 'torch' in sys.modules else 'no torch', code)\n")
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(os.environ.get("PYTHONPATH"))}
    done = subprocess.run([sys.executable, "-c", probe, str(run)], cwd=rlk_pytester.path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.strip().splitlines()[-1] == "no torch 0", done.stdout + done.stderr
