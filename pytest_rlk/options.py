"""Parsing and validation of the ``--rlk-*`` option values (plain functions, no pytest state)."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pytest_rlk.markers import TIERS

UPDATE_MODES = ("failed", "all")
BACKEND_ENV = "VIME_RL_KERNEL_BACKEND"


class OptionError(ValueError):
    """A bad ``--rlk-*`` value; the plugin turns it into a pytest usage error."""


def parse_tiers(text: str) -> list[str]:
    """``"op,module"`` -> ``["op", "module"]``; an unknown or empty tier is an :class:`OptionError`."""
    tiers = [t.strip() for t in text.split(",")]
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers:
        shown = ", ".join(repr(t) for t in bad) or repr(text)
        raise OptionError(
            f"--rlk-tier: unknown tier {shown}; valid tiers: {', '.join(TIERS)} (comma separated)"
        )
    return list(dict.fromkeys(tiers))  # keep order, drop duplicates


def parse_update_mode(text: str | None) -> str | None:
    if text is None:
        return None
    if text not in UPDATE_MODES:
        raise OptionError(
            f"--rlk-update-baselines: unknown mode {text!r}; valid modes: {', '.join(UPDATE_MODES)}"
        )
    return text


def _number(text: str | float | int, kind: type, option: str, what: str):
    """``kind(text)``, or an :class:`OptionError` naming ``option`` and what it expected."""
    try:
        return kind(text)
    except ValueError:
        raise OptionError(f"{option}: {text!r} is not {what}") from None


def parse_refresh_rel(text: str | float | None) -> float | None:
    if text is None:
        return None
    value = _number(text, float, "--rlk-refresh-rel", "a number")
    if value < 0:
        raise OptionError(f"--rlk-refresh-rel: {text!r} must be >= 0")
    return value


def parse_workers_per_gpu(text: str | int | None, shard_gpus: bool) -> int:
    """``--rlk-workers-per-gpu K``: K >= 1 xdist workers share each GPU (only with ``--rlk-shard-gpus``)."""
    if text is None:
        return 1
    value = _number(text, int, "--rlk-workers-per-gpu", "a whole number")
    if value < 1:
        raise OptionError(f"--rlk-workers-per-gpu: {text!r} must be >= 1")
    if value > 1 and not shard_gpus:
        raise OptionError(f"--rlk-workers-per-gpu={value} shares each GPU between xdist workers: it needs "
                          "--rlk-shard-gpus (and -n auto)")
    return value


def parse_platform(text: str | None) -> str | None:
    """A platform tag names a baseline directory: lower-case letters, digits, '-' and '_'."""
    if text is None:
        return None
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", text):
        raise OptionError(
            f"--rlk-platform: {text!r} is not a platform tag (e.g. h100, h200, a100, gb200, cpu)"
        )
    return text


def parse_backend(text: str | None) -> str | None:
    """A backend id (``rlk-triton``) or a dotted factory path (``pkg.module:factory``)."""
    if text is None:
        return None
    text = text.strip()
    if not text:
        raise OptionError("--rlk-backend: empty backend id")
    if ":" in text:
        module, _, factory = text.partition(":")
        if not module or not factory or not all(p.isidentifier() for p in module.split(".")):
            raise OptionError(
                f"--rlk-backend: {text!r} is not a backend id or a 'pkg.module:factory' path"
            )
    return text


def load_backend(name: str) -> str:
    """Load the backend ``--rlk-backend`` names through the kernels' registry, once, at startup:
    its ``id/version``, or an :class:`OptionError` saying why it cannot work (the module does not
    import, has no such factory, the factory raised, or returned something that is not a backend).
    Every tier runs with it, so a backend that cannot load is a usage error, not a run of skips."""
    from pytest_rlk._kernels_guard import import_project_kernels

    try:
        import_project_kernels()
        from kernels import backends
    except ImportError as exc:
        raise OptionError(f"--rlk-backend {name!r}: pytest-rlk's kernels do not import ({exc})") from None
    try:
        backend = backends.get_backend(name)
    except backends.BackendLoadError as exc:
        raise OptionError(f"--rlk-backend {name!r}: {exc}") from None
    except Exception as exc:  # the factory's own error, named
        raise OptionError(f"--rlk-backend {name!r}: its factory raised {type(exc).__name__}: {exc}") from None
    return f"{backend.id}/{backend.version}"


PYTEST_CONFIG_FILES = (("pytest.ini", ""), ("pyproject.toml", "[tool.pytest.ini_options]"),
                       ("tox.ini", "[pytest]"), ("setup.cfg", "[tool:pytest]"))


def _has_pytest_config(folder: Path) -> bool:
    for name, section in PYTEST_CONFIG_FILES:
        path = folder / name
        try:
            if path.is_file() and (not section or section in path.read_text(encoding="utf-8", errors="replace")):
                return True
        except OSError:
            continue
    return False


def check_rootdir_not_taken(args: Sequence[str], invocation_dir: Path, inipath: Path | None) -> None:
    """pytest finds its rootdir and configuration before plugin options are known, so the value
    of ``--rlk-artifacts DIR`` (two words) counts as a test path: an existing DIR outside the
    project makes it the rootdir, and the project's configuration (testpaths, addopts, markers)
    is not read. That run cannot work: an OptionError names the option and the ``=`` form."""
    if inipath is not None:
        return
    here = invocation_dir.resolve()
    if not any(_has_pytest_config(folder) for folder in (here, *here.parents)):
        return
    for option, value in zip(args, args[1:]):
        if option.startswith("--rlk-") and "=" not in option and not value.startswith("-") \
                and (invocation_dir / value).expanduser().exists():
            raise OptionError(
                f"{option} {value}: pytest took {value!r} for a test path and its rootdir (it reads its "
                f"configuration before plugin options are known), so this project's pytest configuration "
                f"was not read; write {option}={value}")


def resolve_dir(value: str | None, rootdir: Path, default: str) -> Path:
    """Relative directories are taken relative to the pytest rootdir, like ``baselines/``."""
    path = Path(value if value is not None else default).expanduser()
    return path if path.is_absolute() else (rootdir / path)


def artifacts_dir(value: str | None, rootdir: Path) -> Path:
    path = resolve_dir(value, rootdir, ".rlk/runs")
    if path.exists() and not path.is_dir():
        raise OptionError(f"--rlk-artifacts: {value!r} is a file, not a directory")
    return path


def baselines_dir(value: str | None, rootdir: Path, update: str | None) -> Path:
    """A baseline directory given explicitly must exist (a typo would read every baseline as
    missing), unless this run records into it; the default ``baselines/`` may be absent."""
    path = resolve_dir(value, rootdir, "baselines")
    if value is not None and update is None and not path.is_dir():
        raise OptionError(f"--rlk-baselines: {value!r} is not a directory (record into a new one "
                          "with --rlk-update-baselines)")
    return path


def existing_dir(value: str | None, option: str) -> Path | None:
    if value is None:
        return None
    path = Path(value).expanduser().resolve()
    if not path.is_dir():
        raise OptionError(f"{option}: {value!r} is not a directory")
    return path


@dataclass
class RlkOptions:
    """The validated ``--rlk-*`` options of one pytest run."""

    tiers: list[str]
    artifacts: Path
    baselines: Path
    update_baselines: str | None = None
    require_baselines: bool = False
    platform_override: str | None = None
    vime_root: Path | None = None
    model_root: Path | None = None
    refresh_rel: float | None = None
    fail_on_improvement: bool = False
    backend: str | None = None
    shard_gpus: bool = False
    workers_per_gpu: int = 1  # > 1: workers share each GPU; timing tests wait for the serial phase
    all_gpu_phase: Path | None = None  # the run dir an all-GPU phase joins (set by its controller)
    extra: dict[str, object] = field(default_factory=dict)


DEFAULT_TIER = "op"


def default_tiers(args: list[str], invocation_dir: Path) -> list[str]:
    """The tiers a run without ``--rlk-tier`` selects: those of the paths it names where every one
    lies in ``suites/<tier>/`` (``pytest suites/plugin`` runs the plugin's tests, ``pytest
    suites/e2e/test_trl_ab.py`` the e2e tier), else the op tier."""
    from pytest_rlk.markers import tier_of

    tiers = []
    for arg in args:
        path = Path(arg.split("::")[0])
        tier = tier_of((path if path.is_absolute() else invocation_dir / path).resolve() / "_", ())
        if tier is None:
            return [DEFAULT_TIER]
        tiers.append(tier)
    return list(dict.fromkeys(tiers)) or [DEFAULT_TIER]


def build_options(getoption, rootdir: Path, args: list[str] | None = None, *,
                  invocation_dir: Path | None = None) -> RlkOptions:
    """Validate everything at once from a ``config.getoption``-like callable; ``args``: the paths
    pytest collects from (``config.args``, relative to ``invocation_dir``, where pytest was started:
    the tiers' default when ``--rlk-tier`` is not given)."""
    update = parse_update_mode(getoption("rlk_update_baselines"))
    tier_text = getoption("rlk_tier")
    return RlkOptions(
        tiers=parse_tiers(tier_text) if tier_text is not None else default_tiers(list(args or []),
                                                                                 invocation_dir or rootdir),
        artifacts=artifacts_dir(getoption("rlk_artifacts"), rootdir),
        baselines=baselines_dir(getoption("rlk_baselines"), rootdir, update),
        update_baselines=update,
        require_baselines=bool(getoption("rlk_require_baselines")),
        platform_override=parse_platform(getoption("rlk_platform")),
        vime_root=existing_dir(getoption("rlk_vime_root"), "--rlk-vime-root"),
        model_root=existing_dir(getoption("rlk_model_root"), "--rlk-model-root"),
        refresh_rel=parse_refresh_rel(getoption("rlk_refresh_rel")),
        fail_on_improvement=bool(getoption("rlk_fail_on_improvement")),
        backend=parse_backend(getoption("rlk_backend")),
        shard_gpus=bool(getoption("rlk_shard_gpus")),
        workers_per_gpu=parse_workers_per_gpu(getoption("rlk_workers_per_gpu"), bool(getoption("rlk_shard_gpus"))),
        all_gpu_phase=existing_dir(getoption("rlk_all_gpu_phase"), "--rlk-all-gpu-phase"),
    )
