"""The roofline table (`rlk report RUN [--performance MD]`) on a synthetic H100 run file.

The run is built through the real recorder and schema with the metric names and tags that
suites/op/rlk_bench.py writes, and saved/loaded through storage, so no GPU is needed.
"""
from __future__ import annotations

import pytest

from pytest_rlk import cli, storage
from pytest_rlk.performance import GENERATED_NOTE, collect, roofline_rows
from pytest_rlk.recorder import MetricRecorder
from pytest_rlk.schema import (
    DeviceInfo,
    PlatformInfo,
    RunManifest,
    RunRecord,
    TestRecord,
)

GPU = "NVIDIA H100 80GB HBM3"


def _bench(rec: MetricRecorder, impl: str, ms: float, limit_ms: float, tags: dict, extra: float | None) -> None:
    """What rlk_bench.measure records for one impl."""
    all_tags = {**tags, "impl": impl, "gpu": GPU}
    rec.record(f"{impl}_ms", ms, unit="ms", direction="lower_is_better", space="time", tags=all_tags,
               gate=impl.startswith("rlk"))
    rec.record(f"{impl}_fraction_of_hbm_limit", limit_ms / ms, direction="higher_is_better", space="ratio",
               tags={**all_tags, "limit_ms": f"{limit_ms:.4f}"})
    if extra is not None:
        rec.record(f"{impl}_peak_extra_bytes", extra, unit="B", direction="lower_is_better", space="memory",
                   tags=all_tags)


def _test_record(rec: MetricRecorder) -> TestRecord:
    return TestRecord(nodeid=rec.nodeid, case=rec.case, tier="op", outcome="passed",
                      metrics=list(rec.metrics.values()))


def synthetic_run(tag: str = "h100", run_id: str = "20261122T000000Z-perf") -> RunRecord:
    logp = MetricRecorder("suites/op/bench_logp.py::test_bench_logp_forward[bf16-T8192-V151936]", tier="op",
                          artifact_root=None)
    tags = {"op": "logp", "pass": "fwd", "dtype": "bf16", "shape": "8192x151936"}
    logp.record("hbm_limit_ms", 0.82, unit="ms", direction="two_sided", space="time",
                tags={**tags, "hbm_GBps": "3030"}, gate=False)
    _bench(logp, "rlk", 0.85, 0.82, tags, 1024.0)
    _bench(logp, "torch_compile", 1.73, 0.82, tags, 5e9)
    _bench(logp, "liger", 0.86, 0.82, tags, 2e6)
    logp.record("speedup_vs_liger", 0.86 / 0.85, direction="higher_is_better", space="ratio", tags=tags, gate=False)

    grpo = MetricRecorder("suites/op/bench_grpo_loss.py::test_bench_grpo_loss_forward_backward[bf16-T8192-V151936]",
                          tier="op", artifact_root=None)
    tags = {"op": "grpo_loss", "pass": "fwd+bwd", "dtype": "bf16", "shape": "8192x151936"}
    grpo.record("hbm_limit_ms", 1.65, unit="ms", direction="two_sided", space="time", tags=tags, gate=False)
    _bench(grpo, "rlk", 1.80, 1.65, {**tags, "host_path": "c++",
                                     "wall_timing": "lowest of 8 rounds' medians (host-bound call)"}, 2.49e9)
    grpo.record("rlk_graph_ms", 1.70, unit="ms", direction="lower_is_better", space="time",
                tags={**tags, "impl": "rlk", "gpu": GPU})
    _bench(grpo, "rlk_inplace", 1.75, 1.65, tags, 0.0)
    _bench(grpo, "torch_compile", 6.44, 1.65, tags, 9e9)
    _bench(grpo, "liger", 2.53, 1.65, tags, 2.49e9)

    small = MetricRecorder("suites/op/bench_logp.py::test_bench_logp_small_launch_bound[1]", tier="op",
                           artifact_root=None)
    tags = {"op": "logp", "pass": "fwd", "dtype": "bf16", "shape": "1x151936", "size": "small"}
    _bench(small, "rlk", 0.012, 0.0001, tags, None)
    small.record("rlk_host_overhead_us", 14.5, unit="us", direction="lower_is_better", space="time",
                 tags={**tags, "ids_check": "0", "block_medians_us": "15.0 14.5 21.25", "host_path": "c++"},
                 gate=False)

    platform = PlatformInfo(tag=tag, detected_tag=tag, device_name=GPU, device_count=1, memory_bytes=80 * 10**9,
                            capability="9.0", driver="580.1", cuda="13.0",
                            devices=[DeviceInfo(index=0, name=GPU, memory_bytes=80 * 10**9, capability="9.0")])
    manifest = RunManifest(run_id=run_id, created_utc="2026-11-22T00:00:00Z",
                           argv=["suites/op", "-m", "bench"], tiers=["op"], platform=platform,
                           software={"torch": "2.11.0+cu130", "triton": "3.6.0", "python": "3.12.3"})
    return RunRecord(manifest=manifest, status="complete", exit_status=0,
                     tests=[_test_record(r) for r in (logp, grpo, small)])


def test_collect_and_rows_follow_the_bench_convention():
    cases = collect(synthetic_run())
    assert [(c.op, c.pass_, c.small) for c in cases] == [
        ("logp", "fwd", False), ("grpo_loss", "fwd+bwd", False), ("logp", "fwd", True)]
    assert cases[0].limit_ms == 0.82 and cases[0].hbm_gbps == "3030"
    assert cases[2].host_overhead_us == 14.5 and cases[2].host_overhead_slowest_us == 21.25
    assert cases[2].host_path == "c++" and cases[2].variant == ""  # a measurement tag, not a variant
    headers, rows = roofline_rows(cases)
    assert headers[-4:] == ["liger ms", "vs liger", "torch_compile ms", "vs torch_compile"]
    by_impl = {(r[0], r[6]): dict(zip(headers, r)) for r in rows}
    assert set(by_impl) == {("logp", "rlk"), ("grpo_loss", "rlk"), ("grpo_loss", "rlk_inplace")}
    grpo = by_impl[("grpo_loss", "rlk")]
    assert grpo["ms"] == "1.8" and grpo["of limit"] == "91.7%" and grpo["peak extra"] == "2.49 GB"
    assert grpo["liger ms"] == "2.53" and grpo["vs liger"] == "1.41x" and grpo["vs torch_compile"] == "3.58x"
    assert by_impl[("grpo_loss", "rlk_inplace")]["peak extra"] == "0 B"
    # the CUDA-graph time (GPU only) where recorded, "-" where not
    assert grpo["GPU ms"] == "1.7" and grpo["GPU of limit"] == "97.1%"
    assert by_impl[("grpo_loss", "rlk_inplace")]["GPU ms"] == "-"
    # the path that served the default call, where its wall time recorded one, and how the wall time
    # was taken (neither a variant: the peers' rows join ours)
    assert grpo["host path"] == "c++" and grpo["variant"] == "-"
    assert by_impl[("grpo_loss", "rlk_inplace")]["host path"] == "-" and by_impl[("logp", "rlk")]["host path"] == "-"


def test_ratio_kl_layout_two_passes_in_one_test():
    """bench_ratio_kl.py: fwd (rlk, torch_compile) and fwd+bwd (rlk_fwd_bwd) in one test."""
    rec = MetricRecorder("suites/op/bench_ratio_kl.py::test_bench_ratio_kl[k2]", tier="op", artifact_root=None)
    tags = {"op": "ratio_kl", "kl_type": "k2", "shape": "16777216", "dtype": "fp32"}
    rec.record("hbm_limit_ms", 0.133, unit="ms", direction="two_sided", space="time",
               tags={**tags, "pass": "fwd"}, gate=False)
    _bench(rec, "rlk", 0.14, 0.133, {**tags, "pass": "fwd"}, 0.0)
    _bench(rec, "torch_compile", 0.15, 0.133, {**tags, "pass": "fwd"}, 0.0)
    rec.record("hbm_limit_fwd_bwd_ms", 0.288, unit="ms", direction="two_sided", space="time",
               tags={**tags, "pass": "fwd+bwd"}, gate=False)
    _bench(rec, "rlk_fwd_bwd", 0.32, 0.288, {**tags, "pass": "fwd+bwd"}, 0.0)
    run = synthetic_run().model_copy(update={"tests": [_test_record(rec)]})
    fwd, fwd_bwd = collect(run)
    assert (fwd.pass_, fwd.limit_ms, sorted(fwd.timings), fwd.variant) == ("fwd", 0.133, ["rlk", "torch_compile"], "kl_type=k2")
    assert (fwd_bwd.pass_, fwd_bwd.limit_ms, sorted(fwd_bwd.timings)) == ("fwd+bwd", 0.288, ["rlk_fwd_bwd"])
    headers, rows = roofline_rows([fwd, fwd_bwd])
    assert [dict(zip(headers, r))["vs torch_compile"] for r in rows] == ["1.07x", "-"]


def test_a_matmul_bound_case_is_set_against_cublas_product_of_the_same_run():
    """linear_logp: its products' TFLOP/s against cuBLAS's own product timed in the same rounds,
    not its bytes against the HBM limit (3.9% of it, which says nothing about a matmul-bound op)."""
    rec = MetricRecorder("suites/op/bench_linear_logp.py::test_linear_logp_speed_vs_peers[fwd]", tier="op",
                         artifact_root=None)
    tags = {"op": "linear_logp", "pass": "fwd", "dtype": "bf16", "shape": "4096x4096x151936", "logits": "kept"}
    rec.record("hbm_limit_ms", 0.31, unit="ms", direction="two_sided", space="time", tags=tags, gate=False)
    _bench(rec, "rlk", 8.0, 0.31, tags, 0.0)
    rec.record("rlk_tflops", 640.0, unit="TFLOP/s", direction="higher_is_better", space="ratio", gate=False,
               tags={**tags, "impl": "rlk", "products": "1.00"})
    rec.record("cublas_mm_tflops", 680.0, unit="TFLOP/s", direction="higher_is_better", space="ratio", gate=False,
               tags={**tags, "impl": "cublas_mm", "products": "1.00"})
    run = synthetic_run().model_copy(update={"tests": [_test_record(rec)]})
    (case,) = collect(run)
    assert case.bound == "matmul" and case.matmul_tflops == 680.0
    headers, rows = roofline_rows([case])
    row = dict(zip(headers, rows[0]))
    assert row["bound"] == "matmul" and row["HBM limit ms"] == "-"
    assert row["of limit"] == "640 TFLOP/s = 94.1% of cuBLAS"
    logp = collect(synthetic_run())[0]
    headers, rows = roofline_rows([logp])
    assert logp.bound == "HBM" and dict(zip(headers, rows[0]))["of limit"] == "96.5%"


def test_report_has_the_table_and_a_bar_chart(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    storage.write_run(run_dir, synthetic_run())
    assert cli.main(["report", str(run_dir)]) == 0
    report = (run_dir / "report" / "report.md").read_text()
    assert "## Performance and A/B\n\n### Roofline" in report
    assert "| logp | fwd | 8192x151936 | bf16 | - | HBM | rlk | 0.85 | 0.82 | 96.5% | - | - | 1.02 kB | - | 0.86 | 1.01x | 1.73 | 2.04x |" in report
    assert "| logp | fwd | 1x151936 | bf16 | rlk | 0.012 | 14.5 | 21.2 | c++ |" in report
    png = run_dir / "report" / "performance_ms.png"
    assert "performance_ms.png" in report and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    pixels = imread(png)
    assert pixels.std() > 0.01  # not a blank canvas


def test_performance_doc_sections_per_platform_are_replaced_not_duplicated(tmp_path, capsys):
    doc = tmp_path / "docs" / "performance.md"
    doc.parent.mkdir()
    doc.write_text("# Kernel performance\n\nHand-written notes stay.\n")
    h100_dir, h200_dir = tmp_path / "runs" / "h100", tmp_path / "runs" / "h200"
    storage.write_run(h100_dir, synthetic_run("h100"))
    storage.write_run(h200_dir, synthetic_run("h200", run_id="20261122T010000Z-h200"))
    for run_dir in (h100_dir, h200_dir, h100_dir):
        # the doc section is under test, not the plots (test_report_has_the_table_and_a_bar_chart)
        assert cli.main(["report", str(run_dir), "--no-plots", "--performance", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Kernel performance\n\nHand-written notes stay.\n")
    assert text.count("rlk-performance:begin platform=h100") == 1
    assert text.count("rlk-performance:begin platform=h200") == 1
    h100 = text.split("rlk-performance:begin platform=h100")[1].split("rlk-performance:end platform=h100")[0]
    assert GENERATED_NOTE in h100 and GPU in h100
    assert "command: `pytest suites/op -m bench`" in h100 and "2026-11-22T00:00:00Z" in h100
    assert "| grpo_loss | fwd+bwd | 8192x151936 | bf16 | - | HBM | rlk_inplace |" in h100
    assert "20261122T010000Z-h200" in text.split("rlk-performance:begin platform=h200")[1]


def test_performance_doc_refused_for_a_run_without_benchmarks(tmp_path, capsys):
    run = synthetic_run()
    run = run.model_copy(update={"tests": [TestRecord(nodeid="t.py::t", case="t", outcome="passed")]})
    storage.write_run(tmp_path / "run", run)
    doc = tmp_path / "performance.md"
    assert cli.main(["report", str(tmp_path / "run"), "--performance", str(doc)]) == 2
    assert "holds no benchmark timings" in capsys.readouterr().err
    assert not doc.exists()


def test_report_without_plots_says_so(tmp_path):
    storage.write_run(tmp_path / "run", synthetic_run())
    assert cli.main(["report", str(tmp_path / "run"), "--no-plots"]) == 0
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    assert "### Roofline" in report and "not drawn (`rlk report --no-plots`)" in report
    assert not list((tmp_path / "run" / "report").glob("*.png"))


@pytest.mark.parametrize("module", ["pytest_rlk.performance", "pytest_rlk.report", "pytest_rlk.cli",
                                    "pytest_rlk.plugin"])
def test_module_imports_neither_matplotlib_nor_torch(module):
    """The GPU machines have no matplotlib; the plugin must not pay for torch at import."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
