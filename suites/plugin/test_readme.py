"""What the README tells a new user stays true: every `rlk` command it shows parses, and what tox
writes into the checkout is ignored by git."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from pytest_rlk.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _rlk_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, re.DOTALL)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()
            if line.startswith("rlk ")]


def test_readme_shows_the_everyday_rlk_commands():
    shown = {" ".join(shlex.split(c)[1:3]) for c in _rlk_commands()}
    assert {"diff latest", "report latest", "e2e list", "e2e plan", "e2e run"} <= shown


@pytest.mark.parametrize("command", _rlk_commands())
def test_every_rlk_command_in_the_readme_parses(command):
    args = build_parser().parse_args(shlex.split(command)[1:])  # argparse exits on a stale command
    assert callable(args.func)


@pytest.mark.parametrize("path", [".venv", ".venv-cpu/bin/python", ".tox/suite/bin/python", ".rlk/runs/latest"])
def test_what_tox_and_runs_write_is_ignored(path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "-q", path], check=False)
    assert done.returncode == 0, f"{path} is not ignored by .gitignore"


def _tox_commands(env: str) -> list[str]:
    import configparser

    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    return [line.strip() for line in parser[f"testenv:{env}"]["commands"].splitlines() if line.strip()]


def test_the_test_command_runs_every_tier_and_the_plugin_tests():
    assert _tox_commands("tests") == ["pytest --rlk-tier=plugin,op,module,e2e {posargs}"]


def test_the_quick_start_leaves_the_slow_cases_out_and_the_readme_says_so():
    pytest_line, report_line = _tox_commands("suite")
    assert pytest_line == 'pytest --rlk-tier=op,module -m "not slow" {posargs}' and report_line == "rlk report latest"
    assert 'pytest --rlk-tier=op,module -m "not slow"' in README


def _marked_slow(path: Path, function: str) -> bool:
    """Whether ``function`` of ``path`` carries ``pytest.mark.slow``, itself or by the module's
    ``pytestmark`` (read from the source: no import, no collection)."""
    import ast

    tree = ast.parse(path.read_text())
    module_marks = [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return any("mark.slow" in mark for mark in module_marks + [ast.unparse(d) for d in node.decorator_list])


# (file, test, its time on a shared 2-core machine, the measurement that put it here)
MEASURED_SLOW = [("suites/module/drift/test_drift_injected.py", "test_injected_kernel_drift_fails_exactly_its_rung",
                  "337 s, the slowest test of a full quick-start run")]


@pytest.mark.parametrize(("path", "function", "measured"), MEASURED_SLOW)
def test_the_cases_measured_at_minutes_stay_out_of_the_quick_start(path, function, measured):
    assert _marked_slow(ROOT / path, function), f"{path}::{function} ({measured}) is not marked slow"


def test_the_slow_check_reads_marks_of_the_function_and_of_the_module(tmp_path):
    marked = tmp_path / "test_m.py"
    marked.write_text("import pytest\n\n@pytest.mark.slow\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n")
    assert _marked_slow(marked, "test_a") and not _marked_slow(marked, "test_b")
    marked.write_text("import pytest\n\npytestmark = [pytest.mark.slow]\n\ndef test_b():\n    pass\n")
    assert _marked_slow(marked, "test_b")


def test_the_readme_tag_diff_names_backends_the_quick_start_installs():
    """After the quick start only our backends and Liger (the `liger` extra) are there."""
    installed = {"rlk-triton", "reference"} | ({"liger"} if "liger" in (ROOT / "tox.ini").read_text() else set())
    values = re.findall(r"--[ab]-tag backend=([\w.-]+)", README)
    assert values and set(values) <= installed


def test_the_baseline_directories_the_readme_names_exist():
    named = set(re.findall(r"`baselines/(\w+)/cpu/`", README))
    assert named == {"module", "e2e"}
    for tier in named:
        assert any((ROOT / "baselines" / tier / "cpu").glob("*.json")), tier
    assert not (ROOT / "baselines" / "op" / "cpu").exists()  # the README says the op tier stores none on CPU


def test_the_readme_names_every_option_a_user_can_give():
    """Every ``--rlk-*`` option of the plugin but the hidden ones (``argparse.SUPPRESS``, set by
    the plugin itself) is in the README's options line."""
    source = (ROOT / "pytest_rlk" / "plugin.py").read_text()
    options = {name for name, rest in re.findall(r'addoption\("(--rlk-[a-z-]+)"(.*)', source)
               if "SUPPRESS" not in rest}
    assert {"--rlk-tier", "--rlk-backend"} <= options
    line = README.split("Options (all under", 1)[1].split("\n\n", 1)[0]
    assert sorted(o for o in options if f"`{o}`" not in line and f"`{o}=" not in line) == []
