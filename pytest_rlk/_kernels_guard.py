"""Import *our* ``kernels`` package, refusing the unrelated PyPI distribution of the same name.

A PyPI package named ``kernels`` exists (transformers uses it for hub kernels). If it shadows
ours, every kernel test would test the wrong thing, so this fails loudly instead.
"""
from __future__ import annotations

import importlib
import sys
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
