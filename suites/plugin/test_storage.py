"""Unit tests of baseline/run file IO: round trips and errors that name the file and field."""
from __future__ import annotations

import json

import pytest

from pytest_rlk import storage
from pytest_rlk.schema import SCHEMA_VERSION, Band, Baseline, BaselineMetric


def _baseline() -> Baseline:
    return Baseline(schema_version=SCHEMA_VERSION, tier="op", case="c1", platform="cpu",
                    metrics={"err": BaselineMetric(ref=1e-6, direction="lower_is_better",
                                                   space="error", band=Band(abs_floor=1e-5))})


def test_baseline_round_trip(tmp_path):
    path = storage.baseline_path(tmp_path, "op", "cpu", "c1")
    assert path == tmp_path / "op" / "cpu" / "c1.json"
    storage.write_baseline(path, _baseline())
    assert storage.load_baseline(path, tier="op", platform="cpu", case="c1") == _baseline()
    assert not list(path.parent.glob(".*.tmp"))  # the atomic write left no temp file


def _write(tmp_path, data) -> object:
    path = tmp_path / "b.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_invalid_json_names_file(tmp_path):
    path = _write(tmp_path, "{not json")
    with pytest.raises(storage.RlkFileError, match=r"b\.json: not valid JSON"):
        storage.load_baseline(path)


def test_wrong_schema_version_names_field(tmp_path):
    data = json.loads(_baseline().model_dump_json())
    data["schema_version"] = 99
    with pytest.raises(storage.RlkFileError, match=r"b\.json: field 'schema_version': is 99"):
        storage.load_baseline(_write(tmp_path, data))


def test_bad_field_is_named(tmp_path):
    data = json.loads(_baseline().model_dump_json())
    data["metrics"]["err"]["band"]["rel"] = "wide"
    with pytest.raises(storage.RlkFileError) as info:
        storage.load_baseline(_write(tmp_path, data))
    assert info.value.field == "metrics.err.band.rel"
    assert str(info.value.path).endswith("b.json")


def test_unknown_field_is_an_error(tmp_path):
    data = json.loads(_baseline().model_dump_json())
    data["metrics"]["err"]["tolerance"] = 1
    with pytest.raises(storage.RlkFileError, match="metrics.err.tolerance"):
        storage.load_baseline(_write(tmp_path, data))


def test_mismatched_location_is_named(tmp_path):
    path = storage.baseline_path(tmp_path, "op", "h100", "c1")
    storage.write_baseline(path, _baseline())  # says platform cpu, lives under h100/
    with pytest.raises(storage.RlkFileError, match="field 'platform': is 'cpu'.*'h100'"):
        storage.find_baseline(tmp_path, "op", "h100", "c1")


def test_resolve_run_arguments(tmp_path):
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    storage.set_latest(tmp_path, run_dir)
    assert storage.resolve_run_dir("latest", tmp_path).resolve() == run_dir.resolve()
    assert storage.resolve_run_dir(run_dir / "run.json") == run_dir
    assert storage.resolve_run_file(run_dir) == run_dir / "run.json"
    with pytest.raises(storage.RlkFileError, match="no latest run"):
        storage.resolve_run_dir("latest", tmp_path / "empty")


def _runs(tmp_path, *ids):
    for run_id in ids:
        (tmp_path / run_id).mkdir(parents=True)
        (tmp_path / run_id / "run.json").write_text("{}")
    return tmp_path


def test_run_id_as_shown_by_the_report_resolves_under_the_artifacts_dir(tmp_path, monkeypatch):
    runs = _runs(tmp_path / "runs", "20261124T152510Z-c80992", "20261124T160000Z-aaaaaa")
    assert storage.resolve_run_dir("20261124T152510Z-c80992", runs) == runs / "20261124T152510Z-c80992"
    assert storage.resolve_run_file("20261124T152510Z-c80992", runs) == runs / "20261124T152510Z-c80992" / "run.json"
    # without --artifacts: .rlk/runs of the current directory or of a parent (like git)
    project = tmp_path / "project"
    _runs(project / ".rlk" / "runs", "20261124T170000Z-bbbbbb")
    (project / "suites" / "op").mkdir(parents=True)
    monkeypatch.chdir(project / "suites" / "op")
    found = storage.resolve_run_dir("20261124T170000Z-bbbbbb")
    assert found.resolve() == (project / ".rlk" / "runs" / "20261124T170000Z-bbbbbb").resolve()


def test_unknown_run_id_lists_the_nearest_ids(tmp_path):
    runs = _runs(tmp_path / "runs", "20261124T152510Z-c80992", "20261124T160000Z-aaaaaa")
    with pytest.raises(storage.RlkFileError) as info:
        storage.resolve_run_dir("20261124T152510Z-c80993", runs)
    message = str(info.value)
    assert message.startswith("20261124T152510Z-c80993: not a run directory, run.json file or run id")
    assert "2 runs; nearest and newest: 20261124T152510Z-c80992, 20261124T160000Z-aaaaaa" in message
    with pytest.raises(storage.RlkFileError, match=r"no runs under .*empty"):
        storage.resolve_run_dir("20261124T152510Z-c80992", tmp_path / "empty")
