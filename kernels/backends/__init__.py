"""Backend registry: built-ins, explicit registrations, dotted paths and entry points.

Lookup order for a name: explicitly registered (``register_backend``), built-in
(``reference``, ``rlk-triton``, and the adapters ``liger`` and ``rl_engine``), a dotted path
``pkg.module:factory``, then the entry-point group ``pytest_rlk.backends``. Backends are created
once per name and cached. The interface a backend implements: kernels/backends/base.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from kernels.backends.base import OPS, Backend, BaseBackend, Capabilities

ENTRY_POINT_GROUP = "pytest_rlk.backends"
BUILTIN_BACKENDS: dict[str, str] = {
    "reference": "kernels.backends.reference:make_backend",
    "rlk-triton": "kernels.backends.triton:make_backend",
    # adapters of third-party libraries: their library is imported only when the backend is loaded
    "liger": "kernels.backends.liger:make_backend",
    "rl_engine": "kernels.backends.rl_engine:make_backend",
}

_factories: dict[str, Callable[[], Backend]] = {}
_instances: dict[str, Backend] = {}


class BackendLoadError(RuntimeError):
    """A backend name or dotted path could not be resolved into a Backend."""


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Register (or replace) a backend factory under ``name``."""
    _factories[name] = factory
    _instances.pop(name, None)


def unregister_backend(name: str) -> None:
    _factories.pop(name, None)
    _instances.pop(name, None)


def load_dotted(path: str) -> Callable[[], Backend]:
    """``pkg.module:factory`` -> the factory callable (errors name the path)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise BackendLoadError(f"backend path {path!r} must look like 'pkg.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendLoadError(f"cannot import backend module {module_name!r} ({exc})") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise BackendLoadError(f"backend module {module_name!r} has no attribute {attr!r}") from exc


def _entry_point_factory(name: str) -> Callable[[], Backend] | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    return None


def _resolve_factory(name: str) -> Callable[[], Backend]:
    if name in _factories:
        return _factories[name]
    if name in BUILTIN_BACKENDS:
        return load_dotted(BUILTIN_BACKENDS[name])
    if ":" in name:
        return load_dotted(name)
    factory = _entry_point_factory(name)
    if factory is None:
        raise BackendLoadError(
            f"unknown backend {name!r}: not registered, not built-in {sorted(BUILTIN_BACKENDS)}, "
            f"not a 'pkg.module:factory' path, not in entry-point group {ENTRY_POINT_GROUP!r}"
        )
    return factory


def get_backend(name: str) -> Backend:
    """The (cached) backend instance for ``name``; raises BackendLoadError naming what failed."""
    if name not in _instances:
        backend = _resolve_factory(name)()
        for attr in ("id", "version", "capabilities", "supports", "get"):
            if not hasattr(backend, attr):
                raise BackendLoadError(f"backend {name!r} lacks {attr!r} (see kernels/backends/base.py)")
        _instances[name] = backend
    return _instances[name]


def loaded_backend(name: str) -> Backend | None:
    """The backend instance for ``name`` if :func:`get_backend` has loaded it, else None (loads nothing)."""
    return _instances.get(name)


def available_backends() -> list[str]:
    """Names known without importing them: registered, built-in and entry points."""
    names = set(_factories) | set(BUILTIN_BACKENDS) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "OPS",
    "Backend",
    "BackendLoadError",
    "BaseBackend",
    "Capabilities",
    "available_backends",
    "get_backend",
    "load_dotted",
    "loaded_backend",
    "register_backend",
    "unregister_backend",
]
