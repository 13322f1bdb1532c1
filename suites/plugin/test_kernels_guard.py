"""The `kernels` name clash guard: a foreign `kernels` package earlier on sys.path is refused."""
from __future__ import annotations

import os
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


class _Dist:
    version = "0.19.1"

    def locate_file(self, path):
        return "/site-packages"


def test_the_hub_kernels_distribution_beside_transformers_is_named():
    from pytest_rlk._kernels_guard import hub_kernels_shadowed

    message = hub_kernels_shadowed(lambda: _Dist(), lambda: True)
    assert "PyPI 'kernels' distribution 0.19.1" in message and "pip uninstall kernels" in message
    assert "CUDAProperties" in message  # the error transformers would raise, so a user can match the two
    assert hub_kernels_shadowed(lambda: None, lambda: True) is None
    assert hub_kernels_shadowed(lambda: _Dist(), lambda: False) is None  # without transformers nothing breaks


def test_a_test_that_needs_transformers_fails_naming_the_hub_kernels_distribution(rlk_pytester, monkeypatch):
    pytest.importorskip("transformers", reason="the check applies where transformers is installed")
    # a real installed distribution: a dist-info directory on the subprocess's path
    site = rlk_pytester.mkdir("site")
    info = site / "kernels-0.19.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    rlk_pytester.makepyfile(**{
        "suites/module/test_model": ("from pytest_rlk.extras import require_extra\n\n"
                                     "def test_model():\n    require_extra('transformers')\n"),
        "suites/op/test_plain": "def test_plain():\n    pass\n"})
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ["PYTHONPATH"]]))
    result = rlk_pytester.runpytest_subprocess("--rlk-tier=op,module")
    result.assert_outcomes(passed=1, failed=1)  # what needs no transformers model runs
    result.stdout.fnmatch_lines(["*PyPI 'kernels' distribution 0.19.1*pip uninstall kernels*"])
