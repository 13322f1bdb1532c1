"""Without the optional extras (transformers, vLLM, megatron-core, TRL, ...), the tests that need
them skip, naming the package and the pytest-rlk extra that installs it; none errors. The
packages are made unimportable in a child pytest (a sitecustomize, inherited by its subprocesses),
not uninstalled."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from pytest_rlk.e2e.processes import pythonpath_first

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("transformers", "tokenizers", "vllm", "megatron", "ray", "trl", "datasets", "liger_kernel")
BLOCKER = '''
import os, sys
from importlib.abc import MetaPathFinder

BLOCKED = set(os.environ["RLK_TEST_BLOCK_MODULES"].split(","))

class Block(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Block())
'''
FILES = ("suites/module/test_training_step.py", "suites/module/test_vllm_drift.py",
         "suites/module/test_vocab_parallel.py", "suites/e2e/test_trl_ab.py",
         # and one test that needs none of them, which still runs
         "suites/module/test_vime_adapter.py::test_custom_loss_matches_vime_math[grpo-kl-reference]")


def test_tiers_skip_what_needs_a_missing_extra(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "RLK_TEST_BLOCK_MODULES": ",".join(BLOCKED),
           "PYTHONPATH": pythonpath_first(tmp_path, ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *FILES, "--rlk-tier=module,e2e", "--rlk-platform=cpu", "-q", "-rs",
         "-p", "no:cacheprovider", "--rlk-artifacts", str(tmp_path / "runs")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert not re.search(r"\d+ (failed|errors?)\b", out), out[-4000:]
    for line in ("needs transformers: install pytest-rlk[cpu] (pip install -e '.[cpu]'; .[gpu], .[trl] also install it)",
                 "needs megatron-core: install pytest-rlk[cpu] (pip install -e '.[cpu]'; .[gpu] also install it)",
                 "needs trl: install pytest-rlk[trl] (pip install -e '.[trl]')"):
        assert line in out, out[-4000:]
    assert "1 passed, 4 skipped" in out
    assert "skipped: 4 (missing package 4)" in out  # the rlk summary counts them by cause
    assert "SKIPPED [1] suites/module/test_vocab_parallel.py:" in out  # reported where the test asks
