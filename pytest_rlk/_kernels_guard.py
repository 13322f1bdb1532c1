"""Import *our* ``kernels`` package, refusing the unrelated PyPI distribution of the same name.

A PyPI package named ``kernels`` exists (transformers uses it for hub kernels). If it shadows
ours, every kernel test would test the wrong thing, so this fails loudly instead. The other way
round is as broken: where that distribution is installed, transformers imports ``kernels`` at
module level (``transformers.integrations.hub_kernels``) whenever a model module loads, gets ours,
and fails with an ImportError deep inside the first model build. ``hub_kernels_shadowed`` names
that where a test asks for transformers (``pytest_rlk.extras.require_extra``).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def import_project_kernels() -> ModuleType:
    """Return the project's ``kernels`` module or raise ImportError naming the file and the fix."""
    module = importlib.import_module("kernels")
    if getattr(module, "__rlk_kernels__", False) is not True:
        raise ImportError(_foreign_message(module))
    return module


def import_project_settings() -> ModuleType:
    """``kernels.settings`` of the project's ``kernels`` (importing it does not import torch), or
    ImportError naming a foreign ``kernels`` package and the fix."""
    import_project_kernels()
    return importlib.import_module("kernels.settings")


def _foreign_message(module: ModuleType) -> str:
    where = getattr(module, "__file__", None) or repr(module)
    return (
        f"the 'kernels' package imported from {where} is not pytest-rlk's kernels (it has no "
        "__rlk_kernels__ marker; probably the PyPI 'kernels' distribution). Fix the "
        "environment: `pip uninstall kernels`, or run from the pytest-rlk checkout root, or "
        "`pip install -e .` in the checkout."
    )


def check_imported_kernels() -> None:
    """If some test module already imported a ``kernels`` package, it must be ours.

    The plugin calls this after collection: it costs nothing (no import) and catches the
    foreign package before any test runs against it.
    """
    module = sys.modules.get("kernels")
    if module is not None and getattr(module, "__rlk_kernels__", False) is not True:
        raise ImportError(_foreign_message(module))


def _installed_kernels_distribution() -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None


def hub_kernels_shadowed(find_distribution: Callable[[], importlib.metadata.Distribution | None]
                         = _installed_kernels_distribution,
                         transformers_present: Callable[[], bool]
                         = lambda: importlib.util.find_spec("transformers") is not None) -> str | None:
    """The problem, or None: the PyPI ``kernels`` distribution is installed beside transformers while
    ``import kernels`` gives ours, so every transformers model build fails (see the module docstring).
    Checked without importing anything."""
    dist = find_distribution()
    if dist is None or not transformers_present():
        return None
    ours = Path(__file__).resolve().parents[1] / "kernels"
    return (f"the PyPI 'kernels' distribution {dist.version} (transformers' hub kernels, installed in "
            f"{dist.locate_file('')}) is shadowed by pytest-rlk's 'kernels' package ({ours}): transformers imports 'kernels' whenever "
            "a model module loads and fails there (ImportError: cannot import name 'CUDAProperties'). The "
            "module and e2e tiers build transformers models: run the suite in an environment without it "
            "(`pip uninstall kernels`).")
