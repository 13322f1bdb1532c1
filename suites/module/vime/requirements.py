"""What a vime checkout and its environment need for the conformance tier, found before any test runs.

Plain functions (no pytest, no imports of the checked code): the conftest turns the findings into one
skip reason per missing piece, so a tree that lacks a module skips with its name instead of erroring
in every test that imports it.

* ``module_closure(roots, entries)``: follows the module-level imports of the ``entries`` (dotted
  names) through the files under ``roots`` (the vime checkout; Megatron-LM's ``megatron.training``),
  the way the interpreter would run them at import: package ``__init__`` files included, imports in
  function bodies, in ``if`` blocks and in ``try`` blocks that catch ``ImportError`` left out (they
  do not run at import, or are optional). Every module it cannot find is a ``Missing`` naming the
  module and the file that imports it.
* ``megatron_commit(vime_root)``: the Megatron-LM commit the checkout's ``docker/Dockerfile`` pins
  (``ARG MEGATRON_COMMIT=...``), or the one vime's Dockerfile pins at a known commit where the
  checkout has none (the message says which).
* ``unpatched_megatron(vime_root, roots)``: vime's image applies the checkout's
  ``docker/patch/<PATCH_VERSION>/megatron.patch`` to that Megatron-LM, and the patch adds flags to
  ``megatron/training/arguments.py``; a Megatron-LM on the path without them parses differently from
  the image, so the parser checks name it instead of running against it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from suites.module.vime import conformance as cf

DOCKERFILE = "docker/Dockerfile"
_MEGATRON_ARG = re.compile(r"^\s*ARG\s+MEGATRON_COMMIT=([0-9a-fA-F]{7,40})\s*$", re.MULTILINE)
# vime's docker/Dockerfile pins this Megatron-LM commit at vime 2b83ea20 (the specs' pin) and at 071e2bcf
# (named where a checkout has none).
KNOWN_MEGATRON_COMMIT = "1dcf0dafa884ad52ffb243625717a3471643e087"
KNOWN_MEGATRON_SOURCE = "vime's docker/Dockerfile at 2b83ea20 and 071e2bcf"
_PATCH_VERSION_ARG = re.compile(r"^\s*ARG\s+PATCH_VERSION=(\S+)\s*$", re.MULTILINE)
MEGATRON_ARGUMENTS_FILE = "megatron/training/arguments.py"
_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/")
_ADDED_FLAG = re.compile(r"^\+.*add_argument\(\s*['\"](--[A-Za-z0-9][A-Za-z0-9-]*)['\"]")
# Packages whose modules the closure follows into their files (the rest: the top-level package must import).
FOLLOWED = ("vime", "megatron.training")
_OPTIONAL_IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


@dataclass(frozen=True)
class Missing:
    """One missing piece: what it is, who needs it, what to do."""

    piece: str
    needed_by: str
    fix: str

    def reason(self) -> str:
        return f"{self.piece}: {self.fix}"


def megatron_commit(vime_root: Path) -> tuple[str, str]:
    """(commit, where it was read) of the Megatron-LM the checkout's image builds."""
    dockerfile = Path(vime_root) / DOCKERFILE
    if dockerfile.is_file():
        match = _MEGATRON_ARG.search(dockerfile.read_text(encoding="utf-8", errors="replace"))
        if match:
            return match.group(1), f"{dockerfile} (MEGATRON_COMMIT)"
        return KNOWN_MEGATRON_COMMIT, f"{KNOWN_MEGATRON_SOURCE}; {dockerfile} names no MEGATRON_COMMIT"
    return KNOWN_MEGATRON_COMMIT, f"{KNOWN_MEGATRON_SOURCE}; this checkout has no {DOCKERFILE}"


def megatron_patch(vime_root: Path) -> Path:
    """The patch vime's docker/Dockerfile applies to Megatron-LM (``ARG PATCH_VERSION``, default ``latest``)."""
    dockerfile = Path(vime_root) / DOCKERFILE
    text = dockerfile.read_text(encoding="utf-8", errors="replace") if dockerfile.is_file() else ""
    match = _PATCH_VERSION_ARG.search(text)
    return Path(vime_root) / "docker" / "patch" / (match.group(1) if match else "latest") / "megatron.patch"


def flags_added_to_megatron_arguments(patch: Path) -> list[str]:
    """The ``--flags`` whose ``add_argument`` lines ``patch`` adds to megatron/training/arguments.py."""
    flags, current = [], None
    for line in patch.read_text(encoding="utf-8", errors="replace").splitlines():
        header = _DIFF_FILE.match(line)
        if header:
            current = header.group(1)
            continue
        added = _ADDED_FLAG.match(line) if current == MEGATRON_ARGUMENTS_FILE else None
        if added and added.group(1) not in flags:
            flags.append(added.group(1))
    return flags


def unpatched_megatron(vime_root: Path, roots: Sequence[Path]) -> list[Missing]:
    """The Megatron-LM ``megatron/training/arguments.py`` on ``roots`` that lacks a flag the checkout's
    megatron.patch adds (nothing to check where the checkout has no such patch, or no Megatron-LM is there:
    the closure names that)."""
    patch = megatron_patch(vime_root)
    if not patch.is_file():
        return []
    flags = flags_added_to_megatron_arguments(patch)
    for root in roots:
        arguments = Path(root) / MEGATRON_ARGUMENTS_FILE
        if not arguments.is_file():
            continue
        text = arguments.read_text(encoding="utf-8", errors="replace")
        absent = [flag for flag in flags if f"'{flag}'" not in text and f'"{flag}"' not in text]
        if not absent:
            return []
        return [Missing(f"{', '.join(absent)} in {arguments} (added by {patch})", "the parser checks",
                        f"apply vime's patch as its docker/Dockerfile does: cd {Path(root)} && git apply --3way {patch}")]
    return []


def _module_file(name: str, roots: Sequence[Path]) -> Path | None:
    """The file that defines module ``name`` under one of ``roots`` (``__init__.py`` for a regular
    package; the directory itself for a namespace package), else None."""
    rel = Path(*name.split("."))
    for root in roots:
        for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
            if candidate.is_file():
                return candidate
        if (root / rel).is_dir():
            return root / rel
    return None


def _is_followed(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FOLLOWED)


def _catches_import_errors(node: ast.Try) -> bool:
    for handler in node.handlers:
        if handler.type is None:
            return True
        names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(n, ast.Name) and n.id in _OPTIONAL_IMPORT_ERRORS for n in names):
            return True
    return False


def _import_time_statements(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    for node in body:
        if isinstance(node, ast.Try):
            if not _catches_import_errors(node):
                yield from _import_time_statements(node.body)
            yield from _import_time_statements(node.finalbody)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" or path.is_dir() else name.rpartition(".")[0]


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of every import ``path`` runs at import time."""
    if path.is_dir():
        return []
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), filename=str(path))
    out = []
    for node in _import_time_statements(tree.body):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
            continue
        base = node.module or ""
        if node.level:
            package = _package_of(name, path).split(".")
            anchor = package[: len(package) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        out.append((base, [alias.name for alias in node.names if alias.name != "*"]))
    return out


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _top_level_present(top: str, provided: Mapping[str, object]) -> bool:
    if top in sys.modules or top in provided:
        return True
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def module_closure(roots: Sequence[Path], entries: Sequence[str], *, provided: Iterable[str] = (),
                   fixes: Mapping[str, str] | None = None, default_fix: str = "") -> list[Missing]:
    """Every module the ``entries`` need at import time that is not there (see the module docstring).

    ``provided``: modules that stand-ins supply. ``fixes``: per top-level name (or dotted prefix), what to
    do about a missing module; ``default_fix`` for the rest."""
    roots = [Path(r) for r in roots]
    provided = set(provided)
    fixes = dict(fixes or {})
    missing: dict[str, Missing] = {}
    seen: set[str] = set()
    queue: list[tuple[str, str]] = [(entry, "the conformance suite") for entry in entries]

    def fix_for(module: str) -> str:
        best = max((p for p in fixes if module == p or module.startswith(p + ".")), key=len, default=None)
        return fixes[best] if best else default_fix

    def note(module: str, needed_by: str, what: str) -> None:
        missing.setdefault(module, Missing(f"{what} (imported by {needed_by})", needed_by, fix_for(module)))

    while queue:
        name, needed_by = queue.pop()
        if name in seen or name in provided:
            continue
        seen.add(name)
        if not _is_followed(name):
            top = name.split(".")[0]
            if not _top_level_present(top, provided):
                note(top, needed_by, f"package {top}")
            continue
        path = _module_file(name, roots)
        if path is None:  # and the outermost missing package: what a checkout at another commit lacks
            absent = next((p for p in _parents(name) if _is_followed(p) and _module_file(p, roots) is None), name)
            note(name, needed_by, f"module {name}" + (f", no package {absent}" if absent != name else ""))
            continue
        queue += [(parent, needed_by) for parent in _parents(name)]
        for module, names in _imports(name, path):
            queue.append((module, str(path)))
            for attr in names:  # `from pkg import sub`: a submodule where a file of that name exists, and
                sub = f"{module}.{attr}"  # always in a namespace package (which defines no attributes)
                if not _is_followed(sub):
                    continue
                package = _module_file(module, roots)
                if _module_file(sub, roots) is not None or (package is not None and package.is_dir()):
                    queue.append((sub, str(path)))
    return sorted(missing.values(), key=lambda m: m.piece)


def files_missing(root: Path, relpaths: Iterable[str], needed_by: str, fix: str) -> list[Missing]:
    return [Missing(f"{root}/{rel}", needed_by, fix) for rel in relpaths if not (Path(root) / rel).is_file()]


def megatron_roots() -> list[Path]:
    """Where ``megatron`` is found on ``sys.path`` (a namespace package: megatron-core and Megatron-LM)."""
    roots = []
    for entry in sys.path:
        base = Path(entry or ".")
        if (base / "megatron").is_dir():
            roots.append(base)
    return roots


# Stand-ins the conftest installs where a module cannot be imported here (named in its docstring).
VLLM_STAND_IN = ("vllm", "vllm.engine", "vllm.engine.arg_utils")
WANDB_UTILS_STAND_IN = "vime.observability.wandb_utils"
WANDB_UTILS_FILE = "vime/observability/wandb_utils.py"


def stand_ins_needed(vime_root: Path) -> list[str]:
    """The modules the conftest's stand-ins supply for this root and environment."""
    names = []
    if importlib.util.find_spec("vllm") is None:
        names += VLLM_STAND_IN
    if not (Path(vime_root) / WANDB_UTILS_FILE).is_file():
        names.append(WANDB_UTILS_STAND_IN)
    return names


@dataclass(frozen=True)
class Need:
    """What the tests that use one fixture import and read: modules (followed to their closure), files."""

    entries: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    fork: bool = False  # entries and files live in the fork's root, not upstream's


# Keyed by the fixture that a test needing it uses (pytest resolves a test's fixtures transitively).
NEEDS: dict[str, Need] = {
    # files: those whose functions and statements the suite compiles (call sites in GPU-only modules)
    "vime_loss": Need(entries=(cf.LOSS_MODULE,), files=(cf.TRAIN_METRIC_UTILS_FILE,)),
    "parser_stand_ins": Need(entries=(cf.ARGUMENTS_MODULE, cf.VLLM_ARGUMENTS_MODULE, cf.MEGATRON_ARGUMENTS_MODULE),
                             files=(cf.ACTOR_FILE,)),
    "init_call_site": Need(entries=("vime.utils.misc",), files=(cf.INITIALIZE_FILE,)),
    "native": Need(files=("vime/utils/ppo_utils.py",)),
    "fork": Need(entries=(cf.PROVIDER_MODULE,), fork=True),
}


def check_tree(vime_root: Path, *, fork_root: Path | None, model_scripts: Iterable[str],
               vime_commits: Iterable[str]) -> dict[str, list[Missing]]:
    """fixture name -> what its tests need that this tree and environment lack (empty lists: all there)."""
    commit, source = megatron_commit(vime_root)
    pinned = ", ".join(sorted({c[:8] for c in vime_commits if c})) or "the spec's vime.commit"
    fixes = {
        "vime": (f"use a vime checkout at the specs' pinned commit ({pinned}) or rebuild the tree with these files "
                 "(docs/e2e-vime.md, 'What a checkout needs')"),
        "megatron": (f"put Megatron-LM at commit {commit} (from {source}) on PYTHONPATH, with vime's "
                     f"{megatron_patch(vime_root).relative_to(vime_root)} applied as the image does: megatron-core "
                     "alone has no megatron.training, Megatron-LM's current HEAD has no megatron.training.tokenizer"),
        "six": "pip install six (Megatron-LM's megatron/training/tokenizer/bert_tokenization.py imports it)",
    }
    provided = stand_ins_needed(vime_root)
    roots_up = [Path(vime_root), *megatron_roots()]
    found: dict[str, list[Missing]] = {}
    for fixture, need in NEEDS.items():
        root = fork_root if need.fork else Path(vime_root)
        if root is None:
            found[fixture] = []  # the vime_fork marker skips these with its own reason
            continue
        roots = [Path(root), *megatron_roots()] if need.fork else roots_up
        missing = files_missing(root, need.files, "the conformance suite", fixes["vime"])
        missing += module_closure(roots, need.entries, provided=provided, fixes=fixes,
                                  default_fix="pip install it into this environment")
        found[fixture] = missing
    found["parser_stand_ins"] += files_missing(Path(vime_root), sorted(set(model_scripts)),
                                               "the specs' vime.model_args_script (MODEL_ARGS)", fixes["vime"])
    found["parser_stand_ins"] += unpatched_megatron(Path(vime_root), megatron_roots())
    return found


def skip_reason(missing: Sequence[Missing]) -> str | None:
    """Every missing piece named once, grouped by what to do about it; None when nothing is missing."""
    if not missing:
        return None
    by_fix: dict[str, list[str]] = {}
    for m in missing:
        pieces = by_fix.setdefault(m.fix, [])
        if m.piece not in pieces:
            pieces.append(m.piece)
    groups = [f"{', '.join(pieces)}: {fix}" for fix, pieces in by_fix.items()]
    return "vime conformance tier: missing " + "; missing ".join(groups)


__all__ = [
    "DOCKERFILE",
    "KNOWN_MEGATRON_COMMIT",
    "NEEDS",
    "Missing",
    "Need",
    "check_tree",
    "files_missing",
    "flags_added_to_megatron_arguments",
    "megatron_commit",
    "megatron_patch",
    "megatron_roots",
    "module_closure",
    "skip_reason",
    "stand_ins_needed",
    "unpatched_megatron",
]
