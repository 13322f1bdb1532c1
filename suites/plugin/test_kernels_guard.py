"""The `kernels` name clash guard: a foreign `kernels` package earlier on sys.path is refused."""
from __future__ import annotations

import sys

import pytest

from pytest_rlk._kernels_guard import import_project_kernels


@pytest.fixture
def fresh_kernels_import(monkeypatch):
    """Forget any imported `kernels` for this test (monkeypatch restores it afterwards)."""
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        monkeypatch.delitem(sys.modules, name)


def test_foreign_kernels_package_is_refused(pytester, fresh_kernels_import):
    pkg = pytester.mkpydir("kernels")
    (pkg / "__init__.py").write_text('"""Stand-in for the PyPI `kernels` distribution."""\n')
    pytester.syspathinsert()
    with pytest.raises(ImportError) as info:
        import_project_kernels()
    message = str(info.value)
    assert str(pkg / "__init__.py") in message
    assert "pip uninstall kernels" in message and "pip install -e ." in message


def test_project_kernels_package_is_accepted(pytester, fresh_kernels_import):
    pkg = pytester.mkpydir("kernels")
    (pkg / "__init__.py").write_text("__rlk_kernels__ = True\n")
    pytester.syspathinsert()
    assert import_project_kernels().__file__ == str(pkg / "__init__.py")


def test_plugin_refuses_a_foreign_kernels_imported_by_tests(rlk_pytester, fresh_kernels_import):
    rlk_pytester.makepyfile(**{
        "kernels/__init__": '"""Stand-in for the PyPI `kernels` distribution."""\n',
        "suites/op/test_uses_kernels": "import kernels\n\ndef test_k():\n    pass\n",
    })
    result = rlk_pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*the 'kernels' package imported from *kernels/__init__.py is not "
                                 "pytest-rlk's kernels*pip uninstall kernels*"])
    runs = rlk_pytester.path / ".rlk" / "runs"  # found while collecting: the run started is removed
    assert not runs.exists() or [p.name for p in runs.iterdir()] == []
