"""The e2e engines, found by name: one package per engine, `engines/<name>/`, exposing `ENGINE`.

`get_engine("trl")` imports `pytest_rlk.e2e.engines.trl` and returns its `ENGINE` (an object
with the methods of `pytest_rlk.e2e.engine.Engine`); the spec's `engine` and its settings section
carry the same name. A new engine is a new folder here and nothing else (docs/e2e-engines.md).
`register_engine` adds one from elsewhere (tests, an out-of-tree package) for the process.

Also here, shared by the TRL engine and the module tier: `tiny_models` (tiny real Qwen3 models
from configs) and `task` (a synthetic task with a verifiable reward).
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Iterator
from typing import Any

# An engine here is an object with the methods of `pytest_rlk.e2e.engine.Engine`, typed `Any`: that
# contract names the spec's types, and the spec looks its engine's section model up here, so naming
# it here would close the import circle spec -> engines -> engine -> spec.
_registered: dict[str, Any] = {}


class UnknownEngineError(LookupError):
    """No engine of that name (the message lists the known ones)."""


def _packaged_names() -> list[str]:
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if info.ispkg)


def engine_names() -> list[str]:
    """Every engine a spec can name: the packages here and the registered ones."""
    return sorted(set(_packaged_names()) | set(_registered))


def get_engine(name: str) -> Any:
    if name in _registered:
        return _registered[name]
    if name not in _packaged_names():
        raise UnknownEngineError(f"unknown engine {name!r} (known: {', '.join(engine_names())})")
    engine = importlib.import_module(f"{__name__}.{name}").ENGINE
    if engine.name != name:
        raise UnknownEngineError(f"{__name__}.{name}.ENGINE is named {engine.name!r}, not {name!r}")
    return engine


def register_engine(engine: Any) -> None:
    """Make `engine` available under `engine.name` in this process (refused for a taken name)."""
    if engine.name in engine_names():
        raise ValueError(f"an engine named {engine.name!r} exists already")
    _registered[engine.name] = engine


def unregister_engine(name: str) -> None:
    _registered.pop(name, None)


@contextlib.contextmanager
def registered(engine: Any) -> Iterator[Any]:
    """`register_engine` for the duration of a `with` block."""
    register_engine(engine)
    try:
        yield engine
    finally:
        unregister_engine(engine.name)
