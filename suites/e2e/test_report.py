"""The e2e report: non-blank PNG plots, a Markdown page with what reproduces the run, and the same
page as one self-contained report.html."""

from __future__ import annotations

import re

import pytest

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.gates import gate_lane, pair_verdict
from pytest_rlk.e2e.engines import UnknownEngineError, get_engine
from pytest_rlk.e2e.report import ArmRun, ReportInputs, phases, write_report
from pytest_rlk.e2e.engines.vime.log import parse_vime_log


def _non_blank(path) -> bool:
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    return pixels.shape[0] > 100 and float(pixels[..., :3].std()) > 0.01


@pytest.fixture
def inputs(fixtures_dir) -> ReportInputs:
    base = parse_vime_log(fixtures_dir / "vime_30b_a3b_baseline.log").series()
    kern = parse_vime_log(fixtures_dir / "vime_30b_a3b_kernels.log").series()
    lane = gate_lane(base, kern, case="qwen3-30b-a3b-h200-grpo-dapo", platform="h200", lane="live", skip_warmup=1)
    return ReportInputs(
        case="qwen3-30b-a3b-h200-grpo-dapo", engine="vime (ray mode)", scope=get_engine("vime").scope, platform="h200", hardware="8x h200, 1 node",
        skip_warmup=1,
        arms=[ArmRun("baseline", "vime", "live", base, command="ray job submit --address=http://127.0.0.1:1 -- train.py",
                     log_path="/runs/live/baseline/job.log", peak_vram_mib_per_gpu={0: 64363.0, 1: 64100.0}),
              ArmRun("kernels", "vime+kernels", "live", kern, command="ray job submit ... --loss-type custom_loss",
                     log_path="/runs/live/kernels/job.log", peak_vram_mib_per_gpu={0: 64363.0, 1: 64000.0})],
        verdict=pair_verdict([lane]), setup_commands=["ray start --head --block --port=1"],
        commits={"vime": "abc123", "pytest-rlk": "def456"}, dirty={"pytest-rlk": True},
        versions={"torch": "2.13.0", "triton": "3.9.0"}, settings={"hyperparameters": {"lr": 1e-6}},
        kernel_switch="VIME_RL_KERNEL=1 --loss-type custom_loss",
    )


def test_all_plots_are_written_and_non_blank(inputs, tmp_path):
    paths = write_report(tmp_path, inputs)
    names = sorted(p.name for p in paths.plots)
    assert names == ["module_breakdown.png", "peak_vram.png", "reward_absdiff.png", "series_steps.png",
                     "step_time_mean.png", "step_time_steps.png"]
    assert all(_non_blank(p) for p in paths.plots)
    text = paths.markdown.read_text()
    assert text.splitlines()[2] == "**PASS**: pair verdict of qwen3-30b-a3b-h200-grpo-dapo on h200"  # first
    assert get_engine("vime").scope in text
    for expected in ("Pair verdict: PASS", "ray job submit --address=http://127.0.0.1:1", "8x h200",
                     '"lr": 1e-06', "VIME_RL_KERNEL=1 --loss-type custom_loss", "/runs/live/kernels/job.log",
                     "| entropy_loss (not compared) | vime (live) |", "miles: raw_reward down",
                     "| peak_vram_mib [MiB] (NVML, max over GPUs) | vime (live) | - | 64363 |"):
        assert expected in text, expected
    lowered = text.lower()
    assert "no claim about mixture-of-experts" in lowered and "not a replacement" in lowered


def test_metric_table_has_mean_percentiles_delta_and_speedup_once(inputs, tmp_path):
    base, kern = ({m.STEP_TIME: [9.0, 2.0, 2.0, 4.0], m.RAW_REWARD: [0.5, 0.5, 0.5, 0.5]},
                  {m.STEP_TIME: [9.0, 1.0, 1.0, 2.0], m.RAW_REWARD: [0.5, 0.5, 0.5, 0.6]})
    arms = [ArmRun(a.role, a.label, a.lane, series, a.command) for a, series in zip(inputs.arms, (base, kern))]
    text = write_report(tmp_path, ReportInputs(**{**inputs.__dict__, "arms": arms})).markdown.read_text()
    table = text.split("## Metrics", 1)[1].split("## Plots", 1)[0]
    assert "| metric | arm | rollouts | mean | p50 | p90 | p99 | Δ mean vs baseline | Δ % | speedup |" in table
    assert "| step_time_s [s] | vime (live) | 3 | 2.667 | 2 | 3.6 | 3.96 |  |  |  |" in table
    assert "|  | vime+kernels (live) | 3 | 1.333 | 1 | 1.8 | 1.98 | -1.333 | -50.0% | 2x |" in table
    assert "|  | vime+kernels (live) | 3 | 0.5333 | 0.5 | 0.58 | 0.598 | +0.03333 | +6.7% | - |" in table
    assert table.count("step_time_s") == 1 and "median" not in table  # one row per arm, p50 not twice


def test_header_names_the_arms_and_commits_carry_dirty_flags_and_versions_apart(inputs, tmp_path):
    text = write_report(tmp_path, inputs).markdown.read_text()
    assert "| lane | metric | baseline arm `vime` | kernel arm `vime+kernels` | band | verdict | detail |" in text
    assert "(fallbacks: required)" not in text
    assert "- pytest-rlk: `def456` (dirty: yes (uncommitted changes))" in text
    assert "- vime: `abc123` (dirty: unknown)" in text
    assert "Software (the arms'): torch 2.13.0, triton 3.9.0" in text


def test_phases_come_from_the_data_and_absent_ones_are_named(inputs, tmp_path):
    series = {m.STEP_TIME: [2.0, 1.0, 1.0], m.ROLLOUT_TIME: [1.0, 0.5, 0.5], "weight_sync_time_s": [0.1, 0.1, 0.1],
              m.ACTOR_TRAIN_TIME: [0.0, 0.4, 0.4], "pg_clipfrac": [0.0, 0.0, 0.0]}
    arms = [ArmRun(a.role, a.label, a.lane, series, a.command) for a in inputs.arms]
    paths = write_report(tmp_path, ReportInputs(**{**inputs.__dict__, "arms": arms}))
    assert phases(arms) == [m.ROLLOUT_TIME, m.ACTOR_TRAIN_TIME, "weight_sync_time_s"]
    text = paths.markdown.read_text()
    assert "not recorded by this engine's arms: log_probs_time_s, ref_log_probs_time_s, update_weights_time_s" in text
    assert "- series left out of series_steps.png: pg_clipfrac: 0 at every step in every arm" in text
    assert "- series_steps.png: not drawn (no other per-step series in this run)" in text


def test_html_report_beside_the_markdown_is_self_contained(inputs, tmp_path):
    paths = write_report(tmp_path, inputs)
    page = paths.html.read_text()
    assert paths.html == tmp_path / "report.html" and page.startswith("<!DOCTYPE html>")
    images = re.findall(r'<img src="([^"]+)"', page)
    assert len(images) == len(paths.plots) and all(i.startswith("data:image/png;base64,") for i in images)
    assert page.index('<p class="verdict"><strong>PASS</strong>') < page.index("<h2")
    assert not re.search(r'(src|href)="(?!data:|#)', page)


def test_missing_data_is_said_not_drawn(inputs, tmp_path):
    arms = [ArmRun(a.role, a.label, a.lane, {m.RAW_REWARD: a.series[m.RAW_REWARD]}, a.command) for a in inputs.arms]
    paths = write_report(tmp_path, ReportInputs(**{**inputs.__dict__, "arms": arms, "verdict": None}))
    assert [p.name for p in paths.plots] == ["reward_absdiff.png"]
    assert paths.markdown.read_text().count("![") == 1  # one figure, nothing drawn empty
    text = paths.markdown.read_text()
    assert "peak_vram.png: not drawn" in text and "No verdict" in text


def test_scope_statement_is_per_engine_and_claims_no_moe_kernel_or_r3_replacement(inputs, tmp_path):
    vime, trl = get_engine("vime").scope, get_engine("trl").scope
    assert "ratio/KL and the GRPO policy loss" in vime
    assert "only TRL's per-token log-probs" in trl and "computed inline by TRL in both arms" in trl
    for text in (vime, trl):
        lowered = text.lower()
        assert "no claim about mixture-of-experts" in lowered
        assert "replac" not in lowered.replace("not a replacement", "")  # R3 is never said to be replaced
    trl_series = {**inputs.arms[0].series, m.PEAK_RSS: [900.0, 950.0], m.LOSS_TIME: [0.1, 0.2],
                  m.OPTIMIZER_TIME: [0.01, 0.02], m.ENTROPY: [2.0, 1.9]}
    arms = [ArmRun(a.role, a.label, a.lane, trl_series, a.command) for a in inputs.arms]
    trl_inputs = ReportInputs(**{**inputs.__dict__, "engine": "trl", "scope": trl, "arms": arms})
    text = write_report(tmp_path, trl_inputs).markdown.read_text()
    assert trl in text and vime not in text
    for row in ("| peak_rss_mib [MiB] | vime (live) |", "| loss_time_s [s] | vime (live) |",
                "| optimizer_time_s [s] | vime (live) |", "| entropy [nat/token] (not compared) | vime (live) |"):
        assert row in text, row
    with pytest.raises(UnknownEngineError, match=r"unknown engine 'verl' \(known: trl, vime\)"):
        get_engine("verl")


def test_report_only_metrics_have_units_and_are_never_gated():
    for name, unit in ((m.PEAK_RSS, "MiB"), (m.LOSS_TIME, "s"), (m.OPTIMIZER_TIME, "s"), (m.ENTROPY, "nat/token")):
        policy = m.E2E_METRICS[name]
        assert policy.unit == unit and policy.group == "report" and not policy.gated
        assert not policy.live and not policy.replay_per_step
    assert m.ENTROPY in m.NEVER_COMPARED and m.ENTROPY_LOSS in m.NEVER_COMPARED


def test_the_cpu_is_named_by_its_model_not_its_architecture():
    from pathlib import Path

    from pytest_rlk.platform import cpu_model

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    if not names:
        pytest.skip("this machine's /proc/cpuinfo names no CPU model")
    assert cpu_model() == names[0]
