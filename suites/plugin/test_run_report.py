"""`rlk report`: a page that reads top-down (verdict, failures and regressions, gate, skips,
performance and A/B, single values, charts) under a table of contents; one margin chart per tier,
single values in one table, no empty charts, injected faults kept apart; none wider than 2000 px,
and the same page as one self-contained report.html."""
from __future__ import annotations

import re
import struct

import pytest
from rlk_plugin_testing import latest_run, latest_run_dir

from pytest_rlk import cli
from pytest_rlk.report_html import anchor

# imported here, before any pytester run: those drop the modules imported while they last, and a
# second import of matplotlib's modules next to the first breaks it
pytest.importorskip("matplotlib", reason="rlk report draws its charts with matplotlib")
pytest.importorskip("pytest_rlk.plots")

AB_RUN = """
import os
import pytest

SCALE = float(os.environ.get("RLK_SCALE", "1.0"))

@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_training(rlk_metrics, kind):
    for arm, slow in (("reference", 1.0), ("kernels", 0.6)):
        rlk_metrics.record(f"{arm}_loss", [1.0, 0.8, 0.7, 0.65], direction="two_sided", space="loss",
                           tags={"arm": arm}, gate=False)
        parts = {"forward": 4.0, "logp": 3.0 * slow, "backward": 8.0}
        for module, ms in parts.items():
            rlk_metrics.record(f"{arm}_{module}_ms", [ms * 2, ms, ms, ms], unit="ms", direction="lower_is_better",
                               space="time", tags={"module": module, "arm": arm}, gate=False)
        rlk_metrics.record(f"{arm}_step_ms", [40.0, 16.0, 16.0, 16.0], unit="ms", direction="lower_is_better",
                           space="time", tags={"module": "step", "arm": arm}, gate=False)
        rlk_metrics.record(f"{arm}_tokens_per_s", 100.0 / slow, direction="higher_is_better", space="throughput",
                           tags={"arm": arm}, gate=False)
    rlk_metrics.record("loss_max_abs_diff", 2e-7 * SCALE, direction="lower_is_better", space="error",
                       band={"abs_floor": 1e-5, "source": "the step's tolerance"})
    rlk_metrics.record("param_drift_rel", 0.0, direction="lower_is_better", space="error",
                       band={"abs_floor": 1e-3, "source": "the step's tolerance"})

@pytest.mark.gpu
def test_on_a_gpu():
    pass

def test_own_skip():
    pytest.skip("the fixture data is regenerated weekly")

def test_broken():
    assert 1 + 1 == 3, "arithmetic is off"

@pytest.mark.injected_fault("a loss 5e-3 off")
def test_a_wrong_loss_is_caught(rlk_metrics):
    rlk_metrics.record("loss_max_abs_diff", 5e-3, direction="lower_is_better", space="error",
                       band={"abs_floor": 1e-5, "source": "the step's tolerance"}, gate=False)
    for arm in ("reference", "kernels"):
        rlk_metrics.record(f"{arm}_loss", [9.0, 9.0], direction="two_sided", space="loss", tags={"arm": arm},
                           gate=False)

def test_counts(rlk_metrics):
    rlk_metrics.record_backend("standin/1")
    rlk_metrics.record("tokens_seen", 128.0, direction="two_sided", space="count", gate=False)
    rlk_metrics.record("zero_series", [0.0, 0.0, 0.0], direction="two_sided", gate=False)
"""


def _png_width(path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">I", data[16:20])[0]


@pytest.fixture
def report(rlk_pytester, monkeypatch):
    rlk_pytester.makepyfile(**{"suites/module/test_ab": AB_RUN})
    rlk_pytester.runpytest("--rlk-tier=module", "--rlk-platform=cpu", "--rlk-update-baselines=all")
    monkeypatch.setenv("RLK_SCALE", "1000")  # loss_max_abs_diff 2e-4: regresses past its band
    rlk_pytester.runpytest("--rlk-tier=module", "--rlk-platform=cpu").assert_outcomes(failed=3, skipped=2, passed=2)
    run_dir = latest_run_dir(rlk_pytester)
    assert cli.main(["report", str(run_dir)]) == 0
    return run_dir / "report"


def test_report_reads_top_down(report):
    text = (report / "report.md").read_text()
    lines = text.splitlines()
    assert lines[2] == "**FAIL**: 3 failed tests, 2 gate regressions"  # the verdict, before anything else
    headings = [line for line in lines if line.startswith("## ")]
    assert headings == ["## Verdict", "## Failures and regressions", "## Gate", "## Skipped, by cause",
                        "## Performance and A/B", "## Single values", "## Charts", "## Failure messages", "## Run"]
    assert lines[4] == "Contents: " + " · ".join(f"[{h[3:]}](#{anchor(h[3:])})" for h in headings)
    summary = text.split("## Verdict", 1)[1].split("## Failures", 1)[0]
    assert "- tests: 3 failed, 2 passed, 2 skipped (1 of them with an injected fault, listed apart)" in summary
    assert "- skipped: 2 (hardware/resources 1, other 1; [reasons](#skipped-by-cause))" in summary
    assert "- kernel backends exercised: standin/1 (1 test)" in summary
    ab = text.split("## Performance and A/B", 1)[1].split("## Single values", 1)[0]
    assert "| test_ab.test_training-dense | tokens_per_s | reference 100; kernels 166.7 | kernels +0.667 |" in ab
    failures = text.split("## Failures and regressions", 1)[1].split("## Gate", 1)[0]
    assert "| test_ab.test_training-dense | loss_max_abs_diff | 2e-07 | 0.0002 | regression |" in failures
    assert "- `suites/module/test_ab.py::test_broken` (failed): AssertionError: arithmetic is off" in failures
    assert "```" not in failures  # one line per failure up here; the whole message comes last
    messages = text.split("## Failure messages", 1)[1].split("## Run", 1)[0]
    assert "- `suites/module/test_ab.py::test_broken` (failed)\n\n  ```\n  AssertionError: arithmetic is off" in messages


def test_gate_table_names_each_case_once_and_its_band_sources_as_notes(report):
    gate = (report / "report.md").read_text().split("## Gate", 1)[1].split("## Skipped", 1)[0]
    rows = [line for line in gate.splitlines() if line.startswith("| test_ab") or line.startswith("|  |")]
    assert [r.split(" | ")[0] for r in rows] == ["| test_ab.test_training-dense", "| ", "| test_ab.test_training-moe", "| "]
    assert all(r.endswith("| [1] |") for r in rows)
    assert "1. the step's tolerance" in gate


def test_injected_faults_are_listed_apart_from_the_real_cases(report, rlk_pytester):
    from pytest_rlk.report_data import report_data

    text = (report / "report.md").read_text()
    injected = text.split("### Injected faults", 1)[1].split("## Gate", 1)[0]
    assert ("| `suites/module/test_ab.py::test_a_wrong_loss_is_caught` | a loss 5e-3 off | passed | 1 error over "
            "tolerance; worst loss_max_abs_diff at 500x its tolerance | - |") in injected
    data = report_data(latest_run(rlk_pytester))
    assert [t.case for t in data.injected] == ["test_ab.test_a_wrong_loss_is_caught"]
    assert all("wrong" not in row.case for rows in data.margins.values() for row in rows)
    assert all("wrong" not in case for case, _, _ in data.arm_series["loss"])
    assert "injected fault" not in text.split("## Charts", 1)[1]


def test_errors_become_one_margin_chart_per_tier_and_single_values_one_table(report):
    text = (report / "report.md").read_text()
    pngs = sorted(p.name for p in report.glob("*.png"))
    assert pngs == ["arms_loss.png", "arms_step_ms.png", "margins_module.png", "time_breakdown.png"]
    charts = text.split("## Charts", 1)[1].split("## Failure messages", 1)[0]
    assert [line for line in charts.splitlines() if line.startswith("### ")] == [
        "### Errors against tolerance", "### A/B arms", "### Time breakdown", "### Series over steps"]
    assert ("*tier module: each case's error divided by its tolerance, worst first; worst: test_ab.test_training-dense "
            "loss_max_abs_diff at 20 of its tolerance; 2 over tolerance (red)*") in charts
    assert "- zero_series: every value of every case is 0 (no chart)" in charts  # said, not drawn
    values = text.split("## Single values", 1)[1].split("## Charts", 1)[0]
    assert "| tokens_seen | count | 1 | 128 (test_ab.test_counts) |" in values
    assert all(_png_width(report / name) <= 2000 for name in pngs)


def test_time_breakdown_stacks_parts_per_arm_never_the_whole(report, rlk_pytester):
    from pytest_rlk.plots import time_breakdown

    found = time_breakdown(latest_run(rlk_pytester))
    assert sorted(found.parts) == [("test_ab.test_training-dense", "kernels"), ("test_ab.test_training-dense", "reference"),
                                   ("test_ab.test_training-moe", "kernels"), ("test_ab.test_training-moe", "reference")]
    kernels = found.parts[("test_ab.test_training-dense", "kernels")]
    assert kernels == pytest.approx({"forward": 4.0, "logp": 1.8, "backward": 8.0})  # medians after warmup
    assert found.whole[("test_ab.test_training-dense", "kernels")] == 16.0  # beside the parts, not on them


def test_html_page_is_self_contained_with_anchors_and_tables_that_wrap(report):
    page = (report / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    for heading in ("Verdict", "Failures and regressions", "Gate", "Skipped, by cause", "Charts", "Run"):
        assert f'<h2 id="{anchor(heading)}">{heading}</h2>' in page
    links = re.findall(r'href="#([^"]+)"', page)
    assert links and all(f'id="{target}"' in page for target in links)  # every link of the contents lands
    images = re.findall(r'<img src="([^"]+)"', page)
    assert len(images) == len(list(report.glob("*.png"))) and all(i.startswith("data:image/png;base64,") for i in images)
    assert page.count("<figcaption>") == len(images)
    regression_rows = re.findall(r'<tr class="regression">(.*?)</tr>', page)
    assert any("loss_max_abs_diff" in row and "<td>regression</td>" in row for row in regression_rows)
    assert page.index('<p class="verdict fail"><strong>FAIL</strong>') < page.index("<h2")  # first on the page
    assert "overflow-wrap: anywhere" in page and "width: 100%" in page  # cells wrap to the page
    assert '<td class="n">2e-07</td>' in page and "td.n { white-space: nowrap;" in page  # numbers never break
    assert not re.search(r'(src|href)="(?!data:|#)', page)  # nothing outside the file


def test_at_most_max_charts_are_drawn_and_the_rest_named(rlk_pytester, report, tmp_path):
    from pytest_rlk.plots import plot_run

    charts = plot_run(latest_run(rlk_pytester), tmp_path, max_charts=1)
    assert [c.path.name for c in charts if c.path] == ["margins_module.png"]
    assert ("arms_loss: not drawn (this report draws at most 1 charts; its values are in metrics.csv)"
            in [c.caption for c in charts])
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["margins_module.png"]


def test_legend_entries_are_wrapped_whole():
    from pytest_rlk.plots import _wrapped

    label = "tiny_training_step_kernels_match_reference-dense / reference" * 2
    lines = _wrapped(label, 30).split("\n")
    assert "".join(lines) == label and all(len(line) <= 30 for line in lines)


def _one_tier_run(values: list[dict[str, float]]):
    """A run of the op tier: one test per entry of ``values``, each metric one value; names ending
    ``_err`` are errors with a tolerance of 1e-4."""
    from pytest_rlk.recorder import MetricRecorder
    from pytest_rlk.schema import PlatformInfo, RunManifest, RunRecord, TestRecord

    tests = []
    for i, metrics in enumerate(values):
        rec = MetricRecorder(f"suites/op/test_many.py::test_case[{i}]", tier="op", artifact_root=None)
        for name, value in metrics.items():
            error = name.endswith("_err")
            rec.record(name, value, direction="lower_is_better" if error else "two_sided",
                       space="error" if error else "count", gate=False,
                       band={"abs_floor": 1e-4, "source": "kernels.tolerances"} if error else None)
        tests.append(TestRecord(nodeid=rec.nodeid, case=rec.case, tier="op", outcome="passed",
                                metrics=list(rec.metrics.values())))
    platform = PlatformInfo(tag="cpu", detected_tag="cpu", device_name="cpu", device_count=0, memory_bytes=0)
    manifest = RunManifest(run_id="20261207T000000Z-many", created_utc="2026-12-07T00:00:00Z", argv=[],
                           tiers=["op"], platform=platform, software={})
    return RunRecord(manifest=manifest, status="complete", exit_status=0, tests=tests)


def test_a_run_of_many_one_value_metrics_stays_a_small_page(tmp_path):
    """Three hundred cases, each with its own one-value metrics and an error against a tolerance:
    one margin chart for the tier and one table, not a chart per metric name."""
    from pytest_rlk.report import write_report

    write_report(_one_tier_run([{f"only_here_{i % 150}_count": float(i), "logp_max_abs_err": 1e-7 * (i + 1)}
                                for i in range(300)]), tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["margins_op.png"]
    text = (tmp_path / "report.md").read_text()
    assert text.count("| only_here_") == 150 and "worst: test_many.test_case-299 logp_max_abs_err at 0.3 of" in text
    assert (tmp_path / "report.html").stat().st_size < 200_000


def test_errors_that_are_all_zero_draw_no_chart_but_say_so(tmp_path):
    from pytest_rlk.plots import plot_run

    charts = plot_run(_one_tier_run([{"logp_max_abs_err": 0.0}, {"logp_max_abs_err": 0.0}]), tmp_path)
    assert [(c.path, c.caption) for c in charts] == [
        (None, "tier op: all 2 errors with a tolerance are exactly 0 (no chart)")]
    assert not list(tmp_path.glob("*.png"))


def test_the_arms_legend_sits_beside_the_axes_inside_the_figure(tmp_path, monkeypatch):
    """A legend over the axes covers the lines it names; one past the figure's edge is cut."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from pytest_rlk import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    cases = [f"tiny_training_step_kernels_match_reference-{kind}-tp1-bf16" for kind in ("dense", "moe")]
    lines = [(case, arm, [1.0, 0.8, 0.7, 0.65]) for case in cases for arm in ("reference", "kernels")]
    plots.plot_arms_over_steps(lines, skip=1, title="loss", ylabel="loss", path=tmp_path / "arms.png")
    (fig,) = figures
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax = fig.axes[0]
    axes_box, legend_box = ax.get_window_extent(renderer), ax.get_legend().get_window_extent(renderer)
    assert legend_box.x0 >= axes_box.x1  # beside the axes, over none of their lines
    assert legend_box.x1 <= fig.bbox.x1 and legend_box.y0 >= fig.bbox.y0  # inside the figure: nothing cut
    labels = ["".join(t.get_text().split("\n")) for t in ax.get_legend().get_texts()]
    assert sum(label.endswith(f"dense-tp1-bf16 / {arm}") for label in labels for arm in ("reference", "kernels")) == 2


def test_the_verdict_counts_each_backends_tests_as_the_summary_does(tmp_path):
    """``1 test``, never ``1 tests``: the report's backends line is the terminal summary's."""
    from pytest_rlk.report import write_report
    from pytest_rlk.table import backend_lines

    run = _one_tier_run([{"logp_max_abs_err": 1e-7}] * 3)
    for test, backend in zip(run.tests, ("liger/0.8.5", "liger/0.8.5", "rlk-triton/0.1.0")):
        test.backends = [backend]
    write_report(run, tmp_path)
    verdict = (tmp_path / "report.md").read_text().split("## Verdict", 1)[1].split("## ", 1)[0]
    assert "- kernel backends exercised: liger/0.8.5 (2 tests), rlk-triton/0.1.0 (1 test)\n" in verdict
    assert backend_lines(run) == ["kernel backends exercised: liger/0.8.5 (2 tests), rlk-triton/0.1.0 (1 test)"]


def test_curves_gather_one_line_per_arm_over_the_runs_tests(tmp_path):
    """Scalars tagged ``curve`` / ``curve_x`` / ``curve_y`` / ``curve_at`` / ``arm`` (the capacity
    benchmark's, one test per arm) become one chart per curve and y axis with a line per arm, its
    points sorted by x, and leave the single-value table."""
    from pytest_rlk.recorder import MetricRecorder
    from pytest_rlk.report import write_report
    from pytest_rlk.report_data import report_data
    from pytest_rlk.schema import TestRecord

    run = _one_tier_run([])
    for arm, points in (("vime", {4096: 3.0, 16384: 9.0}), ("rlk_linear_logp", {65536: 12.0, 4096: 2.0})):
        rec = MetricRecorder(f"suites/module/bench_capacity.py::test_capacity[{arm}]", tier="module", artifact_root=None)
        for tokens, gib in points.items():
            rec.record(f"{arm}_T{tokens}_peak_gib", gib, unit="GiB", direction="lower_is_better", space="memory",
                       gate=False, tags={"arm": arm, "curve": "capacity qwen3_0p6b", "curve_x": "tokens",
                                         "curve_y": "peak memory [GiB]", "curve_at": str(tokens)})
        run.tests.append(TestRecord(nodeid=rec.nodeid, case=rec.case, tier="module", outcome="passed",
                                    metrics=list(rec.metrics.values())))
    data = report_data(run)
    assert data.curves == {("capacity qwen3_0p6b", "tokens", "peak memory [GiB]"): {
        "vime": [(4096.0, 3.0), (16384.0, 9.0)], "rlk_linear_logp": [(4096.0, 2.0), (65536.0, 12.0)]}}
    assert not data.values and not data.arm_scalars
    write_report(run, tmp_path)
    (png,) = tmp_path.glob("curve_*.png")
    assert f"({png.name})" in (tmp_path / "report.md").read_text()
