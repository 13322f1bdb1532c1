"""pytester runs of the run files: schema, report PNGs, xdist merging, interrupted/crashed runs."""
from __future__ import annotations

import json

import pytest
from rlk_plugin_testing import latest_run, latest_run_dir

from pytest_rlk import cli, storage
from pytest_rlk.schema import RunRecord

RECORDING = """
def test_series(rlk_metrics):
    rlk_metrics.set_seed("torch", 1234)
    rlk_metrics.record("loss", [1.0, 0.8, 0.7, 0.65, 0.6], direction="lower_is_better", space="loss",
                       tags={"dtype": "bf16"}, window={"skip": 1, "agg": "mean"})
    (rlk_metrics.artifact_dir / "log.txt").write_text("hello")

def test_scalars(rlk_metrics):
    rlk_metrics.record("logp_max_abs_err", 3e-7, direction="lower_is_better", space="logprob")
    rlk_metrics.record("peak_memory_bytes", 2.5e9, unit="B", direction="lower_is_better", space="memory")
    rlk_metrics.record("fwd_ms", 1.5, unit="ms", direction="lower_is_better", space="time", tags={"module": "logp"})
    rlk_metrics.record("bwd_ms", 2.5, unit="ms", direction="lower_is_better", space="time", tags={"module": "grpo_loss"})
"""


def _recorded_run(pytester):
    pytester.makepyfile(**{"suites/op/test_rec": RECORDING})
    pytester.runpytest().assert_outcomes(passed=2)
    return latest_run_dir(pytester)


def test_run_file_validates_against_the_schema(rlk_pytester):
    run_dir = _recorded_run(rlk_pytester)
    raw = json.loads((run_dir / "run.json").read_text())
    run = RunRecord.model_validate(raw)  # the schema itself, not only our loader
    assert run.status == "complete" and run.exit_status == 0
    m = run.manifest
    assert m.tiers == ["op"] and m.platform.tag and m.software["python"] and m.software["pydantic"]
    assert m.seeds == {"suites/op/test_rec.py::test_series": {"torch": 1234}}
    series = next(t for t in run.tests if t.nodeid.endswith("test_series"))
    assert series.metrics[0].value == [1.0, 0.8, 0.7, 0.65, 0.6] and series.metrics[0].tags == {"dtype": "bf16"}
    assert (run_dir / "tests" / series.case / "log.txt").read_text() == "hello"


def test_report_writes_markdown_and_non_blank_pngs(rlk_pytester):
    image_io = pytest.importorskip("matplotlib.image", reason="rlk report needs matplotlib")
    run_dir = _recorded_run(rlk_pytester)
    out = rlk_pytester.path / "report"
    assert cli.main(["report", str(run_dir), "-o", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "# rlk run" in text and "logp_max_abs_err" in text and "![series_loss]" in text
    pngs = {p.name for p in out.glob("*.png")}
    assert {"series_loss.png", "time_breakdown.png"} <= pngs
    assert "| peak_memory_bytes | memory [B] |" in text  # a single value: a table row, not a chart
    image = image_io.imread(out / "series_loss.png")
    assert image.shape[0] > 100 and float(image[..., :3].std()) > 0.01  # not a blank canvas


def test_xdist_workers_merge_into_one_run(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_par": """
import pytest

@pytest.mark.parametrize("i", range(6))
def test_par(rlk_metrics, i):
    rlk_metrics.record("value", float(i), direction="two_sided")

@pytest.mark.h200
def test_hw():
    pass
"""})
    result = rlk_pytester.runpytest_subprocess("-n", "2", "--rlk-platform=cpu", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6, skipped=1)
    result.stdout.fnmatch_lines(["*= rlk =*", "tiers run: op (7 tests)", "skipped: 1 (hardware/resources 1)",
                                 "gate: 6 missing_baseline"])
    run_dir = latest_run_dir(rlk_pytester)
    assert sorted(p.name for p in (run_dir / "parts").glob("*.json")) == ["gw0.json", "gw1.json"]
    run = storage.load_run(run_dir / "run.json")
    assert run.status == "complete"
    assert sorted(t.metrics[0].value for t in run.tests if t.metrics) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert {t.worker for t in run.tests} == {"gw0", "gw1"}


INTERRUPTED = """
def test_a_records(rlk_metrics):
    rlk_metrics.record("kept", 1.0, direction="two_sided")

def test_b_interrupts():
    raise KeyboardInterrupt

def test_c_never_runs():
    pass
"""


def test_interrupted_run_keeps_its_records(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_int": INTERRUPTED})
    result = rlk_pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    run = latest_run(rlk_pytester)
    assert run.status == "interrupted"
    assert [t.nodeid.split("::")[1] for t in run.tests] == ["test_a_records"]
    assert run.tests[0].metrics[0].name == "kept"


def test_crashed_run_is_readable_through_merge(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_crash": """
import os

def test_a_records(rlk_metrics):
    rlk_metrics.record("kept", 2.0, direction="two_sided")

def test_b_fails():
    worst = {"op": "logp", "max_abs_err": 0.25}
    assert worst["max_abs_err"] < 1e-3, f"logp off by {worst['max_abs_err']}"

def test_c_crashes():
    os._exit(3)
"""})
    result = rlk_pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == 3
    run_dir = latest_run_dir(rlk_pytester)
    assert storage.load_run(run_dir / "run.json").status == "running"  # nobody reached session end
    assert cli.main(["merge", str(run_dir)]) == 0
    run = storage.load_run(run_dir / "run.json")
    assert run.status == "crashed" and run.tests[0].metrics[0].value == 2.0
    # the run died, yet it says why test_b failed: the crash line first, then the source lines
    failed = run.tests[1]
    assert failed.outcome == "failed" and run.tests[0].failure is None
    assert failed.failure.splitlines()[0] == "AssertionError: logp off by 0.25"
    assert 'assert worst["max_abs_err"] < 1e-3' in failed.failure
    assert cli.main(["report", str(run_dir), "--no-plots"]) == 0
    report = (run_dir / "report" / "report.md").read_text()
    failed_section = report.split("## Failure messages", 1)[1]
    assert "`suites/op/test_crash.py::test_b_fails` (failed)" in failed_section
    assert "AssertionError: logp off by 0.25" in failed_section


def test_kernel_fallback_counts_are_recorded(rlk_pytester):
    """A stand-in `kernels` package (not the real one: it only exposes the counters) is imported
    by the test; the plugin reads kernels.fallback_counts() into the run file."""
    rlk_pytester.makepyfile(**{
        "kernels/__init__": ('"""Stand-in for the project kernels: only the identity and counters."""\n'
                             "__rlk_kernels__ = True\n_COUNTS = {}\n\n"
                             "def fallback_counts():\n    return dict(_COUNTS)\n\n"
                             "def backend_id():\n    return 'standin/0'\n"),
        "suites/op/test_fb": ("import kernels\n\ndef test_fb(rlk_metrics):\n"
                              "    kernels._COUNTS['logp'] = 2\n"
                              "    rlk_metrics.record_fallbacks(kernels.fallback_counts())\n"),
    })
    result = rlk_pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["kernel fallbacks: logp=2"])
    run = latest_run(rlk_pytester)
    assert run.fallback_counts == {"logp": 2} and run.tests[0].fallback_counts == {"logp": 2}
    assert run.manifest.kernel_backend_ids == ["standin/0"]


def test_latest_skips_runs_without_results_and_names_partial_ones(rlk_pytester, capsys):
    rlk_pytester.makepyfile(**{"suites/op/test_one": "def test_one(rlk_metrics):\n"
                                                     "    rlk_metrics.record('v', 1.0, direction='two_sided')\n"})
    rlk_pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    with_results = latest_run_dir(rlk_pytester).resolve()
    stray = rlk_pytester.runpytest("-p", "no:cacheprovider", "-k", "no_such_test")
    assert stray.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    stray.stdout.fnmatch_lines(["latest: not moved (this run recorded no test)"])
    assert "rlk diff" not in stray.stdout.str()  # nothing of this run to diff or report
    assert latest_run_dir(rlk_pytester).resolve() == with_results
    runs = str(rlk_pytester.path / ".rlk" / "runs")
    assert cli.main(["--artifacts", runs, "diff", "latest", "--baselines", "baselines"]) == 0
    assert "1 missing_baseline" in capsys.readouterr().out
    rlk_pytester.makepyfile(**{"suites/op/test_int": INTERRUPTED})
    assert rlk_pytester.runpytest_subprocess("-p", "no:cacheprovider").ret == pytest.ExitCode.INTERRUPTED
    assert latest_run_dir(rlk_pytester).resolve() != with_results  # it has results: it is latest
    capsys.readouterr()
    assert cli.main(["--artifacts", runs, "diff", "latest", "--baselines", "baselines"]) == 2  # partial
    assert "pass --allow-partial" in capsys.readouterr().err
    assert cli.main(["--artifacts", runs, "diff", "latest", "--baselines", "baselines", "--allow-partial"]) == 0
    header = capsys.readouterr().out.splitlines()[0]  # test_int.py ran first: 1 test before Ctrl-C
    assert "(interrupted: partial, 1 of 4 tests recorded)" in header


def test_run_files_are_named_in_the_summary(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_table": """
import pytest

@pytest.fixture(scope="module", autouse=True)
def table(rlk_files):
    rows = []
    yield rows
    rlk_files.path("parity.txt", "parity table").write_text("\\n".join(rows) + "\\n")

@pytest.mark.parametrize("i", range(3))
def test_row(table, i):
    table.append(f"row {i}")
"""})
    result = rlk_pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["file: parity table: .rlk/runs/*/files/parity.txt"])
    run = latest_run(rlk_pytester)
    assert open(run.files["parity table"]).read() == "row 0\nrow 1\nrow 2\n"


PROGRESS = """
import pytest

@pytest.fixture(scope="module")
def engine(rlk_progress):
    with rlk_progress.step("engine: load"):
        print("captured engine output")
    return "engine"

def test_before():
    pass

def test_first(engine, rlk_progress):
    rlk_progress("generating 4 prompts")

def test_second():
    pass
"""


def test_progress_lines_reach_the_terminal_through_capture(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_progress": PROGRESS})
    result = rlk_pytester.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([".",  # test_before's dot, then a line of its own for the progress
                                 "rlk: test_first: engine: load ...",
                                 "rlk: test_first: engine: load: done in 0 s",
                                 "rlk: test_first: generating 4 prompts",
                                 ".*[[]100%[]]"])
    assert "captured engine output" not in result.stdout.str()  # the test's own output stays captured
    quiet = rlk_pytester.runpytest("-qq", "-p", "no:cacheprovider")
    assert "rlk: test_first" not in quiet.stdout.str()
