"""Unit tests of option parsing, marker logic, platform tags, the recorder and timing."""
from __future__ import annotations

import math
from pathlib import PurePath

import pytest

from pytest_rlk import markers, options
from pytest_rlk.markers import ServeContext, marker_lines, tier_of, unserved_reason
from pytest_rlk.platform import detect, tag_for, with_override
from pytest_rlk.recorder import MetricError, MetricRecorder, case_from_nodeid
from pytest_rlk.schema import DeviceInfo, PlatformInfo
from pytest_rlk.timing import bench, measure_hbm_bandwidth, peak_extra_memory

CPU = PlatformInfo(tag="cpu", detected_tag="cpu")
H100 = PlatformInfo(tag="h100", detected_tag="h100", device_name="NVIDIA H100 80GB HBM3", device_count=1,
                    memory_bytes=85_000_000_000, capability="9.0",
                    devices=[DeviceInfo(index=0, name="NVIDIA H100 80GB HBM3", memory_bytes=85_000_000_000, capability="9.0")])


def test_parse_tiers():
    assert options.parse_tiers("op, module,op") == ["op", "module"]
    with pytest.raises(options.OptionError, match=r"unknown tier 'gpu'; valid tiers: op, module, e2e, plugin"):
        options.parse_tiers("op,gpu")


def test_parse_update_mode_and_refresh():
    assert options.parse_update_mode("failed") == "failed"
    with pytest.raises(options.OptionError, match="--rlk-update-baselines: unknown mode 'some'"):
        options.parse_update_mode("some")
    assert options.parse_refresh_rel("0.3") == pytest.approx(0.3)
    with pytest.raises(options.OptionError, match="--rlk-refresh-rel"):
        options.parse_refresh_rel("-1")


def test_parse_backend():
    assert options.parse_backend("rlk-triton") == "rlk-triton"
    assert options.parse_backend("my_pkg.backends:make") == "my_pkg.backends:make"
    with pytest.raises(options.OptionError, match="--rlk-backend"):
        options.parse_backend("my-pkg:make")


def test_every_marker_is_registered_with_help():
    names = {line.split(":")[0].split("(")[0] for line in marker_lines()}
    assert names >= {"op", "module", "e2e", "bench", "slow", "vime", "h100", "h200", "a100", "gb200",
                     "gpu", "cpu", "gpus", "gpu_mem", "qwen3_4b", "qwen3_30b_a3b", "glm45_air",
                     "moe", "r3", "tiny"}


def test_tier_from_directory_or_marker():
    assert tier_of(PurePath("suites/op/test_x.py"), []) == "op"
    assert tier_of(PurePath("suites/module/sub/test_x.py"), []) == "module"
    assert tier_of(PurePath("suites/plugin/test_x.py"), []) == "plugin"
    assert tier_of(PurePath("elsewhere/test_x.py"), []) is None
    assert tier_of(PurePath("suites/plugin/test_x.py"), ["e2e"]) == "e2e"


@pytest.mark.parametrize(("marks", "reason"), [
    ([("h200", ())], "needs an H200 (this machine: cpu, 0 GPUs)"),
    ([("h100", ()), ("h200", ())], "needs an H100 or H200 (this machine: cpu, 0 GPUs)"),
    ([("gpu", ())], "needs a GPU (this machine: cpu, 0 GPUs)"),
    ([("gpus", (2,))], "needs 2 GPUs (found 0)"),
    ([("gpu_mem", (80,))], "needs 80 GB GPU memory (found 0)"),
    ([("qwen3_4b", ())], "needs checkpoint qwen3_4b under --rlk-model-root (not given)"),
    ([("vime", ())], "needs a vime checkout (--rlk-vime-root not given)"),
    ([("cpu", ()), ("tiny", ()), ("moe", ()), ("slow", ())], None),
])
def test_unserved_reasons_on_cpu(marks, reason):
    assert unserved_reason(marks, ServeContext(platform=CPU)) == reason


def test_h100_serves_its_markers_but_not_more():
    ctx = ServeContext(platform=H100)
    assert unserved_reason([("h100", ()), ("gpu", ()), ("gpu_mem", (80,))], ctx) is None
    assert unserved_reason([("h200", ())], ctx) == "needs an H200 (this machine: NVIDIA H100 80GB HBM3, 1 GPU)"
    assert unserved_reason([("gpus", (2,))], ctx) == "needs 2 GPUs (found 1)"


def test_model_root_checkpoints(tmp_path):
    (tmp_path / "Qwen3-4B").mkdir()
    ctx = ServeContext(platform=CPU, model_root=tmp_path)
    assert unserved_reason([("qwen3_4b", ())], ctx) is None
    assert "none of glm45_air, GLM-4.5-Air" in unserved_reason([("glm45_air", ())], ctx)


def test_bad_marker_argument_is_an_error():
    with pytest.raises(ValueError, match="marker gpus takes one non-negative number"):
        unserved_reason([("gpus", ("two",))], ServeContext(platform=CPU))


@pytest.mark.parametrize(("name", "cap", "mem", "tag"), [
    ("NVIDIA H100 80GB HBM3", (9, 0), 85e9, "h100"),
    ("NVIDIA H200", (9, 0), 150e9, "h200"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), 85e9, "a100"),
    ("NVIDIA GB200", (10, 0), 200e9, "gb200"),
    ("Hopper OEM part", (9, 0), 150e9, "h200"),
    ("NVIDIA L4", (8, 9), 24e9, "other-gpu"),
])
def test_platform_tag_from_device(name, cap, mem, tag):
    assert tag_for(name, cap, int(mem)) == tag


def test_detect_on_this_machine_and_override():
    info = detect()
    assert info.tag == info.detected_tag
    assert (info.tag == "cpu") == (info.device_count == 0)
    forced = detect("h200")
    assert forced.tag == "h200" and forced.detected_tag == info.detected_tag


def test_cpu_override_hides_the_gpus_other_overrides_keep_them():
    as_cpu = with_override(H100, "cpu")
    assert (as_cpu.tag, as_cpu.detected_tag, as_cpu.device_count, as_cpu.memory_bytes) == ("cpu", "h100", 0, 0)
    assert as_cpu.describe() == "cpu, 0 GPUs"
    assert unserved_reason([("gpu_mem", (80,))], ServeContext(platform=as_cpu)) == "needs 80 GB GPU memory (found 0)"
    as_h200 = with_override(H100, "h200")
    assert (as_h200.tag, as_h200.device_count, as_h200.memory_bytes) == ("h200", 1, H100.memory_bytes)
    assert with_override(H100, None) is H100


def test_recorder_validates_and_names_the_metric(tmp_path):
    rec = MetricRecorder("suites/op/test_x.py::test_y[bf16]", tier="op", artifact_root=tmp_path)
    assert rec.case == case_from_nodeid("suites/op/test_x.py::test_y[bf16]") == "test_x.test_y-bf16"
    rec.record("a", 1, direction="lower_is_better")
    with pytest.raises(MetricError, match="'a': recorded twice"):
        rec.record("a", 2, direction="lower_is_better")
    with pytest.raises(MetricError, match="'b': value nan is not finite"):
        rec.record("b", math.nan, direction="two_sided")
    assert rec.record("b", math.inf, direction="two_sided", allow_nonfinite=True).value == math.inf
    with pytest.raises(MetricError, match="'c': direction 'up'"):
        rec.record("c", 1.0, direction="up")
    with pytest.raises(MetricError, match="'d': space 'bits'"):
        rec.record("d", 1.0, direction="two_sided", space="bits")
    with pytest.raises(MetricError, match="'e'.*skips 5"):
        rec.record("e", [1.0, 2.0], direction="two_sided", window={"skip": 5})
    with pytest.raises(MetricError, match="case 'a/b'"):
        rec.set_case("a/b")
    rec.set_case("logp-bf16-T4096")
    assert rec.artifact_dir == tmp_path / "logp-bf16-T4096" and rec.artifact_dir.is_dir()


def test_bench_on_cpu_reports_quantiles():
    result = bench(lambda: sum(range(1000)), warmup_ms=1, rep_ms=5, device="cpu")
    assert result.n >= 5 and result.device == "cpu"
    assert 0 < result.p20 <= result.median_ms <= result.p80
    assert set(result.quantiles) == {0.5, 0.2, 0.8}
    with pytest.raises(ValueError, match="quantiles"):
        bench(lambda: None, quantiles=(50,))


def test_lowest_of_rounds_takes_the_least_disturbed_round(monkeypatch):
    """A host whose speed comes in regimes: the rounds' medians 0.9, 0.4 (undisturbed), 2.5 ms. The
    result is the lowest round's, the rounds are paused apart, and the bench options reach each."""
    from pytest_rlk import timing

    medians = iter([0.9, 0.4, 2.5])
    seen, pauses = [], []

    def fake_bench(fn, **kwargs):
        seen.append(kwargs)
        median = next(medians)
        return timing.BenchResult(median_ms=median, p20=median, p80=median, mean=median, n=5)

    monkeypatch.setattr(timing, "bench", fake_bench)
    monkeypatch.setattr(timing.time, "sleep", pauses.append)
    lowest = timing.bench_lowest_of_rounds(lambda: None, rounds=3, pause_s=0.1, rep_ms=7, device="cpu")
    assert lowest.median_ms == 0.4
    assert pauses == [0.1, 0.1]
    assert seen == [{"rep_ms": 7, "device": "cpu"}] * 3
    with pytest.raises(ValueError, match="rounds=0"):
        timing.bench_lowest_of_rounds(lambda: None, rounds=0)
    with pytest.raises(ValueError, match="pause_s=-1"):
        timing.bench_lowest_of_rounds(lambda: None, pause_s=-1)


def test_memory_helpers_without_cuda_return_none():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: see test_memory_helpers_on_gpu")
    assert peak_extra_memory(lambda: None) is None
    assert measure_hbm_bandwidth() is None


@pytest.mark.gpu
def test_memory_helpers_on_gpu():
    import torch

    extra = peak_extra_memory(lambda: torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    assert extra >= 64 << 20
    bandwidth = measure_hbm_bandwidth()
    assert 0.5e12 < bandwidth < 10e12  # H100 ~3.0e12, H200 ~4.3e12 bytes/s
    timed = bench(lambda: torch.ones(1 << 20, device="cuda").sum(), device="cuda")
    assert timed.device.startswith("NVIDIA") and timed.median_ms > 0


def test_parse_platform_tag():
    assert options.parse_platform("h200") == "h200"
    with pytest.raises(options.OptionError, match="--rlk-platform: '../x' is not a platform tag"):
        options.parse_platform("../x")


def test_bench_full_runs_only_where_the_expression_names_it():
    assert markers.leaves_out_bench_full("h200")
    assert markers.leaves_out_bench_full("bench")
    assert markers.leaves_out_bench_full("h100 or gpu")
    assert not markers.leaves_out_bench_full("bench_full")
    assert not markers.leaves_out_bench_full("bench_full and h200")
    assert not markers.leaves_out_bench_full(None)  # no -m: every test runs
    assert not markers.leaves_out_bench_full("")


def test_runnable_on_names_every_platform_a_test_can_run_on():
    everywhere = ("h100", "h200", "a100", "gb200", "gpu", "cpu")
    assert markers.runnable_on([]) == everywhere
    assert markers.runnable_on(["cpu", "tiny"]) == everywhere
    assert markers.runnable_on(["gpu"]) == ("h100", "h200", "a100", "gb200", "gpu")
    assert markers.runnable_on(["gpus", "bench"]) == ("h100", "h200", "a100", "gb200", "gpu")
    assert markers.runnable_on(["gpu_mem"]) == ("h100", "h200", "a100", "gb200", "gpu")
    assert markers.runnable_on(["h200", "gpus"]) == ("h200", "gpu")

    assert markers.runnable_on(["h100", "h200"]) == ("h100", "h200", "gpu")


def _getoption(**given):
    defaults = {"rlk_tier": "op", "rlk_require_baselines": False, "rlk_fail_on_improvement": False}
    return lambda name: given.get(name, defaults.get(name))


def test_artifacts_and_baselines_that_cannot_work_are_option_errors(tmp_path):
    a_file = tmp_path / "runs.txt"
    a_file.write_text("")
    with pytest.raises(options.OptionError, match=r"--rlk-artifacts: '.*runs.txt' is a file, not a directory"):
        options.build_options(_getoption(rlk_artifacts=str(a_file)), tmp_path)
    typo = str(tmp_path / "baselnes")
    with pytest.raises(options.OptionError, match=r"--rlk-baselines: '.*baselnes' is not a directory \(record "
                                                  r"into a new one with --rlk-update-baselines\)"):
        options.build_options(_getoption(rlk_baselines=typo), tmp_path)
    # recording into a new directory, and the default baselines/ of a fresh checkout, are fine
    assert options.build_options(_getoption(rlk_baselines=typo, rlk_update_baselines="all"), tmp_path)
    assert options.build_options(_getoption(), tmp_path).baselines == tmp_path / "baselines"


def test_without_rlk_tier_the_paths_given_choose_the_tiers(tmp_path):
    """``pytest suites/plugin`` runs the plugin's tests and ``pytest suites/e2e/x.py`` the e2e tier
    without --rlk-tier; paths outside ``suites/<tier>/`` (or none) keep the op tier."""
    from pytest_rlk.options import default_tiers

    root = tmp_path
    for tier in ("op", "e2e", "plugin"):
        (root / "suites" / tier).mkdir(parents=True)
    assert default_tiers(["suites/plugin"], root) == ["plugin"]
    assert default_tiers(["suites/e2e/test_x.py::test_y", "suites/plugin"], root) == ["e2e", "plugin"]
    assert default_tiers(["suites"], root) == ["op"]
    assert default_tiers([], root) == ["op"]
    assert default_tiers([str(root / "suites" / "e2e")], tmp_path / "elsewhere") == ["e2e"]
