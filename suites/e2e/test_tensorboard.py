"""TensorBoard event reader against an event file written by the real `tensorboard` writer."""

from __future__ import annotations

import shutil

import pytest

from pytest_rlk.e2e.tensorboard import (
    TensorBoardError, TensorBoardScalars, crc32c, cross_check, read_event_file, read_scalars,
)
from pytest_rlk.e2e.engines.vime.log import parse_vime_log

FIXTURE = "vime_tb.tfevents.fixture"  # written by tensorboard's EventFileWriter (simple_value + tensor)


def test_crc32c_known_vector():
    assert crc32c(b"123456789") == 0xE3069283


def test_reads_simple_value_and_tensor_scalars(fixtures_dir, tmp_path):
    shutil.copy(fixtures_dir / FIXTURE, tmp_path / f"events.out.{FIXTURE}")
    tb = read_scalars(tmp_path)
    assert len(tb.files) == 1 and not tb.truncated
    assert tb.scalars["rollout/raw_reward"][1] == pytest.approx(0.0125, rel=1e-6)
    assert tb.scalars["perf/step_time"] == pytest.approx({0: 97.0, 1: 95.9, 2: 96.3}, rel=1e-6)


def test_agrees_with_stdout_and_flags_a_disagreement(fixtures_dir, tmp_path):
    tb = TensorBoardScalars()
    read_event_file(fixtures_dir / FIXTURE, tb)
    log = parse_vime_log(fixtures_dir / "vime_30b_a3b_baseline.log")
    assert cross_check(log.records["rollout"], tb) == ([], []) and cross_check(log.records["perf"], tb) == ([], [])
    log.records["perf"][1]["perf/step_time"] = 80.0
    problems, _ = cross_check(log.records["perf"], tb)
    assert len(problems) == 1 and "perf/step_time at 1" in problems[0]
    # matched in order, not by step number: a scaled step axis still lines up
    tb.scalars["perf/step_time"] = {10 * s: v for s, v in tb.scalars["perf/step_time"].items()}
    log.records["perf"][1]["perf/step_time"] = 95.9
    assert cross_check(log.records["perf"], tb) == ([], [])
    del log.records["perf"][2]
    assert "2 values on stdout, 3 in TensorBoard" in cross_check(log.records["perf"], tb)[1][0]


def test_truncated_file_is_reported_and_corruption_raises(fixtures_dir, tmp_path):
    data = (fixtures_dir / FIXTURE).read_bytes()
    cut = tmp_path / "a.tfevents.cut"
    cut.write_bytes(data[:-7])
    tb = TensorBoardScalars()
    read_event_file(cut, tb)
    assert tb.truncated and "truncated record" in tb.truncated[0]
    assert tb.scalars["rollout/raw_reward"]  # the complete records before the cut are kept
    bad = tmp_path / "b.tfevents.bad"
    flipped = bytearray(data)
    flipped[30] ^= 0xFF
    bad.write_bytes(bytes(flipped))
    with pytest.raises(TensorBoardError, match=r"b.tfevents.bad: bad data CRC at byte \d+"):
        read_event_file(bad, TensorBoardScalars())
