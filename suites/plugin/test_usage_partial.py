"""Usage errors leave no run behind; runs stopped early (Ctrl-C, SIGTERM) are finalized and say
how to merge and report them; ``rlk diff`` refuses a partial run unless asked; the rlk section
is the last one printed."""
from __future__ import annotations

import pytest
from rlk_plugin_testing import latest_run, latest_run_dir

from pytest_rlk import cli, markers

ONE_TEST = "def test_one(rlk_metrics):\n    rlk_metrics.record('v', 1.0, direction='two_sided')\n"
SIGTERMED = """
import os, signal

def test_a_records(rlk_metrics):
    rlk_metrics.record("kept", 1.0, direction="two_sided")

def test_b_is_terminated():
    os.kill(os.getpid(), signal.SIGTERM)

def test_c_never_runs():
    pass
"""


def test_marker_expression_names():
    assert markers.marker_expression_names("h100") == ["h100"]
    assert markers.marker_expression_names("(h200 and vime) or not slow") == ["h200", "vime", "slow"]
    assert markers.marker_expression_names('device(serial="a(b", n=3) and gpu') == ["device", "gpu"]


def test_unknown_marker_error_names_it_and_the_registered_ones():
    message = markers.unknown_marker_error("h1000 or gpu", ["h100", "h200", "gpu"])
    assert message == ("-m 'h1000 or gpu': unknown marker 'h1000' (nearest: h100, h200); "
                       "registered markers: gpu, h100, h200")
    assert markers.unknown_marker_error("h100 or not gpu", ["h100", "gpu"]) is None


def test_an_unknown_marker_in_m_is_a_usage_error_and_leaves_no_run(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_one": ONE_TEST})
    result = rlk_pytester.runpytest("-m", "h1000")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*-m 'h1000': unknown marker 'h1000' (nearest: h100*); registered markers: *h100*"])
    assert not (rlk_pytester.path / ".rlk" / "runs").exists()
    rlk_pytester.runpytest("-m", "h100 and not slow").assert_outcomes(passed=1)  # registered: runs


def test_sigterm_finalizes_the_run_as_ctrl_c_does_and_says_how_to_merge_and_report(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_term": SIGTERMED})
    result = rlk_pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    run = latest_run(rlk_pytester)
    assert run.status == "interrupted"
    assert [t.nodeid.split("::")[1] for t in run.tests] == ["test_a_records"]
    run_dir = latest_run_dir(rlk_pytester).resolve()
    result.stdout.fnmatch_lines([f"rlk: run *{run_dir.name} (should this process die before its summary: rlk merge *",
                                 "*= rlk =*",
                                 "run status: interrupted: partial, 1 of 3 tests recorded; artifacts: *",
                                 f"merge: rlk merge *{run_dir.name}*",
                                 f"report: rlk report *{run_dir.name}   diff: rlk diff *{run_dir.name} --allow-partial"])


def test_diff_of_a_partial_run_exits_2_unless_allowed(rlk_pytester, capsys):
    rlk_pytester.makepyfile(**{"suites/op/test_term": SIGTERMED})
    rlk_pytester.runpytest_subprocess("-p", "no:cacheprovider")
    run_dir = str(latest_run_dir(rlk_pytester))
    assert cli.main(["diff", run_dir, "--baselines", str(rlk_pytester.path)]) == 2
    assert "interrupted: partial, 1 of 3 tests recorded; a diff of it says nothing of the tests it did not " \
           "record: rerun it, or pass --allow-partial" in capsys.readouterr().err
    assert cli.main(["diff", run_dir, run_dir]) == 2
    assert cli.main(["diff", run_dir, "--baselines", str(rlk_pytester.path), "--allow-partial"]) == 0
    assert f"vs the baselines in {rlk_pytester.path}/ (platform" in capsys.readouterr().out


def test_the_rlk_section_is_printed_after_pytests_short_summary(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_s": "import pytest\n\ndef test_s():\n    pytest.skip('why')\n"})
    result = rlk_pytester.runpytest("-ra")
    lines = result.stdout.lines
    short = next(i for i, line in enumerate(lines) if "short test summary info" in line)
    rlk = next(i for i, line in enumerate(lines) if "= rlk =" in line)
    assert short < rlk
    assert lines[-2].startswith("report: rlk report ") and "1 skipped" in lines[-1]


def test_the_project_does_not_ask_pytest_for_every_skip_line():
    """``-ra`` in addopts would print a SKIPPED line per skip (about 90 in the quick start) above
    the rlk section, which groups them by cause."""
    from rlk_plugin_testing import REPO_ROOT
    import tomllib

    addopts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert not any(opt.startswith("-r") for opt in addopts.split())


def test_rlk_help_lists_every_command_and_report_names_the_html(capsys):
    parser = cli.build_parser()
    text = parser.format_help()
    commands = next(a for a in parser._subparsers._group_actions).choices
    assert {"diff", "report", "merge", "env"} <= set(commands)
    for name in commands:
        assert f"    {name} " in text, name
    assert "commands: " + ", ".join(commands) in " ".join(text.split())
    assert "report.html" in " ".join(text.split())
    report_help = " ".join(commands["report"].format_help().split())
    assert "an A/B directory (rlk e2e run --out DIR)" in report_help  # rlk report DIR takes one


def test_the_summary_counts_what_m_deselected(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_m": "import pytest\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n\n"
                                                   "def test_quick():\n    pass\n"})
    result = rlk_pytester.runpytest("-m", "not slow")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["deselected by -m 'not slow': 1 test; tox -e tests runs the slow ones"])


def test_a_signal_while_the_run_finishes_is_noted_not_raised():
    """tox stops a run with SIGINT, then SIGTERM 0.3 s later: the second lands while the run
    writes run.json, and must not cut that write."""
    import os
    import signal

    from pytest_rlk.signals import StopSignals

    outer = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # this session's own StopSignals, aside
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stops = StopSignals()
    try:
        assert stops.install()
        with pytest.raises(KeyboardInterrupt, match="SIGTERM received"):
            os.kill(os.getpid(), signal.SIGTERM)
        stops.finishing()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert stops.received == ["SIGTERM", "SIGTERM", "SIGINT"]
    finally:
        stops.restore()
        restored = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGTERM, outer)
    assert restored == before


def test_a_usage_error_found_while_collecting_leaves_no_run(rlk_pytester):
    """pytest finds a missing path only as it collects, after the run directory exists: the
    directory goes again, as no test reached it."""
    rlk_pytester.makepyfile(**{"suites/op/test_one": ONE_TEST})
    result = rlk_pytester.runpytest("--rlk-tier=op", "suites/op/test_no_such_file.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*not found: *test_no_such_file.py*"])
    runs = rlk_pytester.path / ".rlk" / "runs"
    assert not runs.exists() or not [p for p in runs.iterdir() if p.name != "latest"]
    assert "run status:" not in result.stdout.str()  # no summary of a run that is not there
