"""`rlk report`: a summary page first, charts grouped with captions (arms overlaid, errors against
their tolerance, the time breakdown per arm with parts only), none wider than 2000 px, and the
same page as one self-contained report.html."""
from __future__ import annotations

import re
import struct

import pytest
from rlk_plugin_testing import latest_run, latest_run_dir

from pytest_rlk import cli

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
    rlk_pytester.runpytest("--rlk-tier=module", "--rlk-platform=cpu").assert_outcomes(failed=3, skipped=2)
    run_dir = latest_run_dir(rlk_pytester)
    assert cli.main(["report", str(run_dir)]) == 0
    return run_dir / "report"


def test_report_starts_with_a_summary(report):
    text = (report / "report.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## Summary", "## Charts", "## Skipped, by cause", "## Failed", "## Gate", "## Run"]
    summary = text.split("## Summary", 1)[1].split("## Charts", 1)[0]
    assert "**FAIL**: 3 failed tests, 2 gate regressions" in summary
    assert "- tests: 3 failed, 2 skipped" in summary
    assert "- skipped: 2 (hardware/resources 1, other 1; reasons below)" in summary
    assert "| test_ab.test_training-dense | loss_max_abs_diff | 2e-07 | 0.0002 | regression |" in summary
    assert "- `suites/module/test_ab.py::test_broken` (failed): AssertionError: arithmetic is off" in summary


def test_charts_overlay_arms_and_draw_tolerances(report):
    text = (report / "report.md").read_text()
    charts = text.split("## Charts", 1)[1].split("## Skipped", 1)[0]
    assert [line for line in charts.splitlines() if line.startswith("### ")] == [
        "### Errors vs tolerance", "### A/B arms", "### Time breakdown"]
    pngs = sorted(p.name for p in report.glob("*.png"))
    assert pngs == ["arms_loss.png", "arms_step_ms.png", "errors_loss_max_abs_diff.png",
                    "errors_param_drift_rel.png", "time_breakdown.png"]  # one chart for both arms
    assert "*loss over steps, arms overlaid (colour: arm; line style: case)" in charts
    assert "red tick: the case's tolerance (the step's tolerance); 2 case(s) above it (red bars)" in charts
    assert all(_png_width(report / name) <= 2000 for name in pngs)


def test_time_breakdown_stacks_parts_per_arm_never_the_whole(report, rlk_pytester):
    from pytest_rlk.plots import time_breakdown

    found = time_breakdown(latest_run(rlk_pytester))
    assert sorted(found.parts) == [("test_ab.test_training-dense", "kernels"), ("test_ab.test_training-dense", "reference"),
                                   ("test_ab.test_training-moe", "kernels"), ("test_ab.test_training-moe", "reference")]
    kernels = found.parts[("test_ab.test_training-dense", "kernels")]
    assert kernels == pytest.approx({"forward": 4.0, "logp": 1.8, "backward": 8.0})  # medians after warmup
    assert found.whole[("test_ab.test_training-dense", "kernels")] == 16.0  # beside the parts, not on them


def test_html_page_is_self_contained(report):
    page = (report / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    for heading in ("Summary", "Charts", "Skipped, by cause", "Failed", "Gate", "Run"):
        assert f"<h2>{heading}</h2>" in page
    images = re.findall(r'<img src="([^"]+)"', page)
    assert len(images) == len(list(report.glob("*.png"))) and all(i.startswith("data:image/png;base64,") for i in images)
    assert page.count("<figcaption>") == len(images)
    regression_rows = re.findall(r'<tr class="regression">(.*?)</tr>', page)
    assert any("loss_max_abs_diff" in row and "<td>regression</td>" in row for row in regression_rows)
    assert '<p class="fail"><strong>FAIL</strong>' in page
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing outside the file
