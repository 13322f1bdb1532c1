"""The conformance tier's up-front check of a vime tree (``requirements.py``) on trees built here.

The trees are a few lines of our own written into ``tmp_path`` (no vime code): a module that imports
what is there, what is not, what is optional and what only a function imports.
"""

from __future__ import annotations

import importlib.abc
import sys
from pathlib import Path

import pytest

from suites.module.vime import requirements as rq


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


class _Refuse(importlib.abc.MetaPathFinder):
    """A finder that makes ``names`` unimportable, as in an environment without them."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@pytest.fixture
def without(monkeypatch):
    def hide(*names: str) -> None:
        for name in names:
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setattr(sys, "meta_path", [_Refuse(*names), *sys.meta_path])
    return hide


def test_closure_names_every_missing_module_and_only_those_run_at_import(tmp_path, without):
    without("six")
    root = _write(tmp_path / "vime_tree", {
        "vime/__init__.py": "",
        "vime/utils/__init__.py": "",
        "vime/utils/present.py": "import json\n",
        "vime/backends/loss.py": (
            "from vime.utils.present import x\n"
            "from vime.data.tensor import TensorRef\n"
            "from .cp_utils import gather\n"
            "from vime.utils import http_utils\n"
            "import six\n"
            "try:\n    import optional_accelerator\nexcept ImportError:\n    optional_accelerator = None\n"
            "if False:\n    import only_when_typing\n"
            "def later():\n    import only_in_a_function\n"
        ),
    })
    missing = rq.module_closure([root], ["vime.backends.loss"], fixes={"six": "pip install six"},
                                default_fix="install it")
    pieces = {m.piece.split(" (")[0]: m for m in missing}
    assert set(pieces) == {"module vime.data.tensor, no package vime.data", "module vime.backends.cp_utils",
                           "package six"}, pieces
    assert pieces["package six"].fix == "pip install six"
    assert pieces["module vime.data.tensor, no package vime.data"].needed_by.endswith("vime/backends/loss.py")


def test_from_a_namespace_package_imports_a_submodule(tmp_path):
    """``from vime.utils import http_utils`` where ``vime/utils`` has no ``__init__.py``: only a file can
    provide it, so its absence is missing."""
    root = _write(tmp_path / "t", {"vime/a.py": "from vime.utils import http_utils\n", "vime/utils/other.py": ""})
    assert [m.piece.split(" (")[0] for m in rq.module_closure([root], ["vime.a"])] == ["module vime.utils.http_utils"]


def test_megatron_without_the_tokenizer_is_named_with_the_commit_to_use(tmp_path):
    """A Megatron-LM whose ``megatron.training`` lacks ``tokenizer`` (as at its current HEAD)."""
    vime_root = _write(tmp_path / "vime_tree", {
        "vime/args.py": "from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding\n",
        "docker/Dockerfile": "FROM base\nARG MEGATRON_COMMIT=0123456789abcdef0123456789abcdef01234567\n",
    })
    megatron = _write(tmp_path / "megatron_lm", {"megatron/training/__init__.py": "", "megatron/training/arguments.py": ""})
    commit, source = rq.megatron_commit(vime_root)
    assert commit == "0123456789abcdef0123456789abcdef01234567" and "docker/Dockerfile" in source
    missing = rq.module_closure([vime_root, megatron], ["vime.args"],
                                fixes={"megatron": f"use Megatron-LM at {commit}"})
    assert [m.piece.split(" (")[0] for m in missing] == [
        "module megatron.training.tokenizer.tokenizer, no package megatron.training.tokenizer"]
    assert commit in missing[0].fix


def test_the_megatron_commit_without_a_dockerfile_is_the_known_pin(tmp_path):
    commit, source = rq.megatron_commit(tmp_path)
    assert commit == rq.KNOWN_MEGATRON_COMMIT and "has no docker/Dockerfile" in source


def test_an_empty_tree_skips_with_one_reason_naming_each_piece(tmp_path):
    root = _write(tmp_path / "empty", {"vime/__init__.py": ""})
    found = rq.check_tree(root, fork_root=None, model_scripts=["scripts/models/qwen3-4B.sh"], vime_commits=["2b83ea20aa"])
    assert found["fork"] == []  # no fork root: the vime_fork marker's own skip
    reason = rq.skip_reason(found["parser_stand_ins"])
    for piece in ("module vime.utils.arguments", "scripts/models/qwen3-4B.sh", "2b83ea20"):
        assert piece in reason, (piece, reason)
    assert reason.count("scripts/models/qwen3-4B.sh") == 1
    assert rq.skip_reason([]) is None


_PATCH = """diff --git a/megatron/core/transformer/transformer_config.py b/megatron/core/transformer/transformer_config.py
+    group.add_argument('--not-in-arguments', action='store_true')
diff --git a/megatron/training/arguments.py b/megatron/training/arguments.py
@@ -1701,6 +1704,8 @@ def _add_network_size_args(parser):
     group.add_argument('--make-vocab-size-divisible-by', type=int, default=128,
+    group.add_argument('--use-gated-attention', action='store_true',
+                       help='If set, use gated attention')
diff --git a/megatron/training/training.py b/megatron/training/training.py
+    parser.add_argument("--not-in-arguments-either")
"""


def test_the_flags_vimes_megatron_patch_adds_to_the_parser(tmp_path):
    """Only ``add_argument`` lines the patch adds to megatron/training/arguments.py count; the patch's
    directory is the Dockerfile's ``ARG PATCH_VERSION``."""
    root = _write(tmp_path / "vime_tree", {"docker/Dockerfile": "ARG PATCH_VERSION=v2\n",
                                            "docker/patch/v2/megatron.patch": _PATCH})
    assert rq.megatron_patch(root) == root / "docker/patch/v2/megatron.patch"
    assert rq.flags_added_to_megatron_arguments(rq.megatron_patch(root)) == ["--use-gated-attention"]
    assert rq.megatron_patch(tmp_path) == tmp_path / "docker/patch/latest/megatron.patch"


def test_a_megatron_without_vimes_patch_is_named_with_the_command_that_applies_it(tmp_path):
    vime_root = _write(tmp_path / "vime_tree", {"docker/patch/latest/megatron.patch": _PATCH})
    core_only = _write(tmp_path / "site", {"megatron/core/__init__.py": ""})  # megatron-core: no training
    plain = _write(tmp_path / "plain", {rq.MEGATRON_ARGUMENTS_FILE: "group.add_argument('--make-vocab-size-divisible-by')\n"})
    patched = _write(tmp_path / "patched", {rq.MEGATRON_ARGUMENTS_FILE: "group.add_argument('--use-gated-attention')\n"})
    missing = rq.unpatched_megatron(vime_root, [core_only, plain])
    assert len(missing) == 1
    assert missing[0].piece.startswith(f"--use-gated-attention in {plain / rq.MEGATRON_ARGUMENTS_FILE}")
    assert missing[0].fix.endswith(f"cd {plain} && git apply --3way {vime_root / 'docker/patch/latest/megatron.patch'}")
    assert rq.unpatched_megatron(vime_root, [core_only, patched]) == []
    assert rq.unpatched_megatron(vime_root, [patched, plain]) == []  # the first on the path is the one imported
    assert rq.unpatched_megatron(tmp_path / "no_patch", [plain]) == []


def test_check_tree_names_an_unpatched_megatron_for_the_parser_tests_only(tmp_path, monkeypatch):
    vime_root = _write(tmp_path / "vime_tree", {"vime/__init__.py": "", "docker/patch/latest/megatron.patch": _PATCH})
    plain = _write(tmp_path / "plain", {rq.MEGATRON_ARGUMENTS_FILE: ""})
    monkeypatch.setattr(sys, "path", [str(plain), *sys.path])
    found = rq.check_tree(vime_root, fork_root=None, model_scripts=[], vime_commits=["2b83ea20aa"])
    assert "--use-gated-attention in" in rq.skip_reason(found["parser_stand_ins"])
    assert "--use-gated-attention" not in (rq.skip_reason(found["vime_loss"]) or "")
