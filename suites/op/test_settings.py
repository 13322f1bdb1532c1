"""kernels.settings: every environment variable the project reads, declared once, read fast, documented.

* each VIME_RL_KERNEL_* / RLK_* name in the product (kernels/, pytest_rlk/, .ci/) is declared, and
  kernels/ reads the environment only through the settings module;
* one parser per type: flags take 1/true/yes/on and 0/false/no/off, blank is the default, anything
  else is an error naming the variable; a read follows monkeypatch.setenv/delenv at once;
* ``rlk env`` prints value, default and source; docs/settings.md is the module's rendering.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import settings
from kernels.settings import SETTINGS, Setting, parse_flag

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_DOC = ROOT / "docs" / "settings.md"
NAME = re.compile(r"\b(?:VIME_RL_KERNEL|RLK)_[A-Z][A-Z0-9_]*\b|\bVIME_RL_KERNEL\b")
# names of the form that are not environment variables: macros of the CUDA source, and the e2e
# specs' stand-in for the run directory (pytest_rlk/e2e/placeholders.py never reads it)
NOT_SETTINGS = {"RLK_THREADS", "RLK_MIN_CTAS", "RLK_DEFINE", "RLK_DEFINE_DTYPE", "RLK_RUN_DIR"}
PRODUCT_FILES = [*ROOT.glob("kernels/**/*.py"), *ROOT.glob("pytest_rlk/**/*.py"), *ROOT.glob(".ci/*")]


def test_every_variable_the_product_names_is_declared():
    undeclared = {}
    for path in PRODUCT_FILES:
        for name in set(NAME.findall(path.read_text())) - NOT_SETTINGS - set(SETTINGS):
            undeclared.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert undeclared == {}, "declare these in kernels/settings.py (and regenerate docs/settings.md)"


def _environment_reads(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            found.append(f"{path.relative_to(root)}:{node.lineno} os.{node.attr}")
    return found


def test_kernels_read_the_environment_only_through_the_settings_module():
    reads = [r for path in sorted(ROOT.glob("kernels/**/*.py")) if path.name != "settings.py"
             for r in _environment_reads(path)]
    assert reads == []


def test_the_environment_check_finds_a_direct_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nFLAG = os.environ.get('RLK_X')\n")
    assert _environment_reads(bad, tmp_path) == ["bad.py:2 os.environ"]


@pytest.mark.parametrize(("text", "expected"), [("1", True), ("on", True), (" YES ", True), ("true", True),
                                                ("0", False), ("off", False), ("No", False), ("false", False)])
def test_flag_words(text, expected):
    assert parse_flag(text.strip()) is expected


def test_a_flag_follows_the_environment_at_every_read(monkeypatch):
    monkeypatch.delenv("VIME_RL_KERNEL_CHECK_FINITE", raising=False)
    assert settings.CHECK_FINITE.get() is False and settings.CHECK_FINITE.source() == "default"
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_FINITE", "on")
    assert settings.CHECK_FINITE.get() is True and settings.CHECK_FINITE.source() == "environment"
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_FINITE", "  ")
    assert settings.CHECK_FINITE.get() is False  # blank: the default
    monkeypatch.setenv("VIME_RL_KERNEL_CHECK_FINITE", "0")
    assert settings.CHECK_FINITE.get() is False
    monkeypatch.delenv("VIME_RL_KERNEL_CHECK_FINITE")
    assert settings.CHECK_FINITE.get() is False


def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("VIME_RL_KERNEL", "2")
    with pytest.raises(ValueError, match=r"VIME_RL_KERNEL='2': expected one of 1/true/yes/on or 0/false/no/off"):
        settings.KERNELS.get()
    monkeypatch.setenv("RLK_LINEAR_LOGP_GROUP_T", "-3")
    with pytest.raises(ValueError, match="RLK_LINEAR_LOGP_GROUP_T='-3': expected a positive int"):
        settings.LINEAR_LOGP_GROUP_T.get()
    monkeypatch.setenv("RLK_LINEAR_LOGP_BWD_MATMUL", "cublas")
    with pytest.raises(ValueError, match=r"RLK_LINEAR_LOGP_BWD_MATMUL='cublas': expected one of \('torch', 'triton'\)"):
        settings.LINEAR_LOGP_BWD_MATMUL.get()


def test_typed_values(monkeypatch):
    monkeypatch.setenv("VIME_RL_KERNEL_OPS", "logp, grpo_loss")
    assert settings.OPS.get() == frozenset({"logp", "grpo_loss"})
    monkeypatch.setenv("VIME_RL_KERNEL_OPS", "*")
    assert settings.OPS.get() is None
    monkeypatch.setenv("RLK_LINEAR_LOGP_TILES", "64,128,32,4,2")
    assert settings.LINEAR_LOGP_TILES.get() == settings.TileConfig(64, 128, 32, 4, 2)
    monkeypatch.setenv("RLK_CUDA_CACHE", "~/somewhere")
    assert settings.CUDA_CACHE.get() == Path.home() / "somewhere"


def test_a_setting_without_os_environ_data_reads_through_os_environ(monkeypatch):
    """Where os.environ has no bytes store (another platform or Python), reads take os.environ.get."""
    setting = Setting("RLK_SETTINGS_TEST_FLAG", parse_flag, False, "test", readers=("suites",))
    monkeypatch.setenv("RLK_SETTINGS_TEST_FLAG", "1")
    monkeypatch.setattr(settings, "_POSIX", False)
    assert setting.get() is True


def test_rlk_env_prints_value_default_and_source(monkeypatch, capsys):
    from pytest_rlk.cli import main as rlk_main

    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "yes")
    monkeypatch.delenv("VIME_RL_KERNEL", raising=False)
    assert rlk_main(["env"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == set(SETTINGS)
    assert rows["VIME_RL_KERNEL_STRICT"][1:] == ["on", "off", "environment"]
    assert rows["VIME_RL_KERNEL"][1:] == ["off", "off", "default"]
    monkeypatch.setenv("VIME_RL_KERNEL", "maybe")
    assert rlk_main(["env"]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("VIME_RL_KERNEL "))
    assert "INVALID (VIME_RL_KERNEL='maybe': expected one of" in row and row.endswith("environment")


def test_settings_doc_is_the_rendering_of_the_module():
    """docs/settings.md is generated: `rlk env --markdown > docs/settings.md` after changing a setting."""
    assert SETTINGS_DOC.read_text() == settings.render_markdown()
    for name in SETTINGS:
        assert f"`{name}`" in SETTINGS_DOC.read_text()


def test_the_plugin_writes_the_declared_backend_variable():
    from pytest_rlk import options

    assert options.BACKEND_ENV == settings.BACKEND.name


def test_reading_settings_does_not_import_torch():
    """The plugin and `rlk env` read settings at startup: importing them must stay cheap."""
    code = "import sys, kernels.settings, kernels; kernels.settings.KERNELS.get(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr
