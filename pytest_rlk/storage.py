"""Baseline and run files on disk: load, validate, write atomically. Errors name file + field."""
from __future__ import annotations

import difflib
import json
import os
import tempfile
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from pytest_rlk.schema import (
    BASELINE_SCHEMA_VERSION,
    BASELINE_SCHEMA_VERSIONS_READ,
    SCHEMA_VERSION,
    Baseline,
    PartFile,
    RunRecord,
)

M = TypeVar("M", bound=BaseModel)
RUN_FILE = "run.json"
LATEST = "latest"


class RlkFileError(Exception):
    """A run or baseline file that cannot be used; ``str()`` names the file and the field."""

    def __init__(self, path: Path | str, field: str | None, message: str) -> None:
        self.path = Path(path)
        self.field = field
        where = f"{self.path}" + (f": field {field!r}" if field else "")
        super().__init__(f"{where}: {message}")


def write_json_atomic(path: Path, data: str | dict | BaseModel) -> None:
    """Write to a temp file in the same directory, then os.replace: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, BaseModel):
        text = data.model_dump_json(indent=2)
    elif isinstance(data, dict):
        text = json.dumps(data, indent=2, sort_keys=True)
    else:
        text = data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RlkFileError(path, None, "no such file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RlkFileError(path, None, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def _validate(path: Path, model: type[M], data: object) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        more = f" (+{exc.error_count() - 1} more errors)" if exc.error_count() > 1 else ""
        raise RlkFileError(path, field, f"{err['msg']}{more}") from None


def _check_version(path: Path, data: object, read: tuple[int, ...] = (SCHEMA_VERSION,)) -> None:
    if not isinstance(data, dict):
        raise RlkFileError(path, None, "expected a JSON object")
    if "schema_version" not in data:
        raise RlkFileError(path, "schema_version", "missing")
    if data["schema_version"] not in read:
        reads = " or ".join(str(v) for v in read)
        raise RlkFileError(
            path, "schema_version",
            f"is {data['schema_version']!r}, this pytest-rlk reads {reads}; re-record it "
            "with --rlk-update-baselines=all",
        )


# -- baselines ---------------------------------------------------------------------------------

def baseline_path(root: Path, tier: str | None, platform: str, case: str) -> Path:
    return root / (tier or "untiered") / platform / f"{case}.json"


def load_baseline(path: Path, *, tier: str | None = None, platform: str | None = None,
                  case: str | None = None) -> Baseline:
    """Load and validate; ``tier``/``platform``/``case`` given must match the file's fields."""
    data = _read_json(path)
    _check_version(path, data, BASELINE_SCHEMA_VERSIONS_READ)
    baseline = _validate(path, Baseline, data)
    if baseline.schema_version == 1 and baseline.history is not None:
        raise RlkFileError(path, "history", f"a schema_version 1 file has no history (version "
                           f"{BASELINE_SCHEMA_VERSION} files have)")
    for field, want in (("tier", tier), ("platform", platform), ("case", case)):
        have = getattr(baseline, field)
        if want is not None and have != want:
            raise RlkFileError(path, field, f"is {have!r} but the file's location says {want!r}")
    return baseline


def find_baseline(root: Path, tier: str | None, platform: str, case: str) -> tuple[Path, Baseline | None]:
    path = baseline_path(root, tier, platform, case)
    if not path.exists():
        return path, None
    return path, load_baseline(path, tier=tier or "untiered", platform=platform, case=case)


def write_baseline(path: Path, baseline: Baseline) -> None:
    write_json_atomic(path, baseline)


# -- runs --------------------------------------------------------------------------------------

def load_run(path: Path) -> RunRecord:
    data = _read_json(path)
    _check_version(path, data)
    return _validate(path, RunRecord, data)


def write_run(run_dir: Path, run: RunRecord) -> Path:
    path = run_dir / RUN_FILE
    write_json_atomic(path, run)
    return path


def load_part(path: Path) -> PartFile:
    return _validate(path, PartFile, _read_json(path))


def set_latest(artifacts: Path, run_dir: Path) -> None:
    """``artifacts/latest`` -> ``run_dir`` (a symlink; a text file where symlinks fail).

    The session moves it when a run records its first test result (:mod:`pytest_rlk.session`):
    a run that selected nothing, or was stopped before any test, leaves it where it was."""
    link = artifacts / LATEST
    tmp = artifacts / f".{LATEST}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name, target_is_directory=True)
    except OSError:
        tmp.write_text(run_dir.name + "\n", encoding="utf-8")
    os.replace(tmp, link)


DEFAULT_ARTIFACTS = Path(".rlk") / "runs"
NEAREST_SHOWN = 5


def default_artifacts(start: Path | None = None) -> Path:
    """``.rlk/runs`` of the current directory or the nearest parent that has one (like git finds
    its repository), else ``.rlk/runs`` here."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / DEFAULT_ARTIFACTS).is_dir():
            return folder / DEFAULT_ARTIFACTS
    return DEFAULT_ARTIFACTS


def run_ids(artifacts: Path) -> list[str]:
    """The run directories under ``artifacts`` (those holding a run file), oldest first."""
    if not artifacts.is_dir():
        return []
    return sorted(p.name for p in artifacts.iterdir()
                  if p.is_dir() and not p.is_symlink() and (p / RUN_FILE).exists())


def _not_found(text: str, base: Path) -> RlkFileError:
    known = run_ids(base)
    if not known:
        return RlkFileError(text, None, f"not a run directory, run.json file or run id (no runs under {base})")
    nearest = difflib.get_close_matches(text, known, n=NEAREST_SHOWN, cutoff=0.3)
    newest = [r for r in reversed(known) if r not in nearest][:NEAREST_SHOWN - len(nearest)]
    shown = ", ".join(nearest + newest)
    return RlkFileError(text, None, f"not a run directory, run.json file or run id under {base} "
                        f"({len(known)} runs; nearest and newest: {shown})")


def resolve_run_dir(arg: str | Path, artifacts: Path | None = None) -> Path:
    """A run dir, a run.json path, a run id (``20261124T152510Z-c80992``, as the report and the
    summary show it) or ``latest``; ids and ``latest`` are looked up in ``artifacts`` (default:
    :func:`default_artifacts`). Not found: an error listing the nearest run ids."""
    text = str(arg)
    base = artifacts if artifacts is not None else default_artifacts()
    if text == LATEST:
        link = base / LATEST
        if link.is_symlink() or link.is_dir():
            return link.resolve()
        if link.is_file():
            return base / link.read_text(encoding="utf-8").strip()
        raise RlkFileError(link, None, "no latest run (no run under it has recorded a test yet: run "
                           "pytest first, or pass a run directory)")
    path = Path(text)
    if path.is_dir():
        return path
    if path.name == RUN_FILE or path.suffix == ".json":
        return path.parent
    if len(path.parts) == 1 and (base / text / RUN_FILE).exists():
        return base / text
    raise _not_found(text, base)


def resolve_run_file(arg: str | Path, artifacts: Path | None = None) -> Path:
    text = str(arg)
    if text != LATEST and Path(text).suffix == ".json":
        return Path(text)
    return resolve_run_dir(arg, artifacts) / RUN_FILE


def load_model(path: Path, model: type[M]) -> M:
    """Any other schema'd JSON file (a nightly plan, ...): errors name the file and the field."""
    return _validate(path, model, _read_json(path))
