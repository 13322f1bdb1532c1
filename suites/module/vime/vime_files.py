"""vime's files read and run piece by piece, where importing the module would drag in what cannot
run here (Ray actors, torch_memory_saver, CUDA-only Megatron init). Plain functions (no pytest).

* ``parse_train_argv(root, argv)``: a ``train.py`` command line through vime's own parser phases
  (``vime/utils/arguments.py``: the pre-parser, the vLLM parser, Megatron's parser with vime's
  arguments); returns the namespace and the flags none of them knows (vime ignores those silently).
* ``model_args(root, script)``: the ``MODEL_ARGS`` array a vime model script defines (sourced by bash).
* ``source_function`` / ``source_statement``: one function or statement of a vime file, compiled from
  the file itself; ``apply_validate_derivations`` and ``actor_forward_plan`` run such statements of
  vime's argument validation and of its actor's forward planning.

Importing vime's real modules from a checkout and running its loss: conformance.py.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import shlex
import subprocess
import sys
from argparse import Namespace
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from suites.module.vime.conformance import (
    ACTOR_FILE,
    ARGUMENTS_MODULE,
    MEGATRON_ARGUMENTS_MODULE,
    VLLM_ARGUMENTS_MODULE,
    VimeTreeError,
    eager_torch_compile,
    use_vime_root,
)


# --- vime's argument parser -------------------------------------------------------------------------


@dataclass
class ParsedArgv:
    """What vime's parser phases make of one ``train.py`` command line."""

    namespace: Namespace  # Megatron's parser with vime's arguments (megatron_parse_args, HF check skipped)
    unknown: list[str]  # flags no phase knows, in command-line order (vime drops them without a word)


def _flags(tokens: Sequence[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("-") and len(t) > 1 and not _is_number(t)]


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


@contextmanager
def _argv(argv: Sequence[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = ["train.py", *argv]
    try:
        yield
    finally:
        sys.argv = saved


@contextmanager
def _recording_leftovers(leftovers: list[list[str]]) -> Iterator[None]:
    """Record what every ``ArgumentParser.parse_known_args`` call leaves over (the real method runs)."""
    original = argparse.ArgumentParser.parse_known_args

    def recording(self, args=None, namespace=None):
        parsed, rest = original(self, args, namespace)
        leftovers.append(list(rest))
        return parsed, rest

    argparse.ArgumentParser.parse_known_args = recording
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


def parse_train_argv(root: Path, argv: Sequence[str],
                     preload: Mapping[str, ModuleType] | None = None) -> ParsedArgv:
    """Parse ``argv`` the way ``train.py``'s ``parse_args`` does (``vime/utils/arguments.py``).

    vime parses the command line three times, each with ``parse_known_args``: ``_pre_parse_mode``
    (``--train-backend``, ``--debug-*``, ``--load-debug-rollout-data``), ``vllm_parse_args`` (the
    ``--vllm-*`` flags, skipped in train-only runs) and Megatron's ``parse_args(extra_args_provider=
    get_vime_extra_args_provider(), ignore_unknown_args=True)`` inside ``megatron_parse_args``. A flag
    none of the three knows is dropped silently; here it is returned in ``unknown``. All three phases
    run even for a train-only command line, so a vLLM flag counts as known there too (vime ignores it
    in that mode by design). ``megatron_parse_args`` runs with ``skip_hf_validate=True``: the HF
    checkpoint a spec names is a placeholder here, and comparing its config is not flag parsing.
    """
    arguments = use_vime_root(root, ARGUMENTS_MODULE, preload)
    with eager_torch_compile():
        vllm_arguments = importlib.import_module(VLLM_ARGUMENTS_MODULE)
        megatron_arguments = importlib.import_module(MEGATRON_ARGUMENTS_MODULE)
    leftovers: list[list[str]] = []
    with _argv(argv), _recording_leftovers(leftovers):
        try:
            arguments._pre_parse_mode()
            vllm_arguments.vllm_parse_args()
            namespace = megatron_arguments.megatron_parse_args(
                extra_args_provider=arguments.get_vime_extra_args_provider(), skip_hf_validate=True)
        except SystemExit as exc:  # argparse's error(): a bad value for a known flag
            raise ValueError(f"vime's parser rejected the command line (exit {exc.code}); argparse's "
                             f"message is in the captured stderr: {shlex.join(argv)}") from None
    unknown_sets = [set(_flags(rest)) for rest in leftovers]
    unknown = set.intersection(*unknown_sets) if unknown_sets else set()
    return ParsedArgv(namespace=namespace, unknown=[f for f in dict.fromkeys(_flags(argv)) if f in unknown])


def model_args(root: Path, script: str) -> list[str]:
    """The ``MODEL_ARGS`` bash array a vime model script (``scripts/models/*.sh``) defines.

    The e2e planner runs ``bash -c 'source "$0" && exec "$@" "${MODEL_ARGS[@]}"' SCRIPT python3
    train.py ...``: the script's array is appended to the command line; this sources it the same way.
    """
    path = Path(root) / script
    if not path.is_file():
        raise VimeTreeError(f"{root} has no {script} (the model script the spec sources for MODEL_ARGS)")
    out = subprocess.run(["bash", "-c", 'source "$0" && printf "%s\\0" "${MODEL_ARGS[@]}"', str(path)],
                         capture_output=True, text=True, timeout=30, check=False, env={"PATH": os.environ["PATH"]})
    if out.returncode != 0:
        raise VimeTreeError(f"sourcing {path} failed ({out.returncode}): {out.stderr.strip()}")
    return [a for a in out.stdout.split("\0") if a]


# --- single functions / statements of vime files ----------------------------------------------------


def _parse_file(root: Path, relpath: str) -> tuple[Path, ast.Module]:
    path = Path(root) / relpath
    if not path.is_file():
        raise VimeTreeError(f"{root} has no {relpath}")
    return path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _find_function(tree: ast.AST, qualname: str, path: Path) -> ast.FunctionDef:
    node: ast.AST = tree
    for part in qualname.split("."):
        found = next((n for n in ast.iter_child_nodes(node)
                      if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if found is None:
            raise VimeTreeError(f"{path} has no {qualname}")
        node = found
    assert isinstance(node, ast.FunctionDef)
    return node


def source_function(root: Path, relpath: str, name: str, namespace: dict) -> Callable:
    """Compile the top-level function ``name`` of a vime file alone, with the globals in ``namespace``.

    For a function whose module imports what cannot run here: the function's own text from the
    checkout runs, its module's other imports do not."""
    path, tree = _parse_file(root, relpath)
    node = _find_function(tree, name, path)
    module = ast.Module(body=[node], type_ignores=[])
    scope = dict(namespace)
    exec(compile(module, str(path), "exec"), scope)  # noqa: S102 - the checkout's own function text
    return scope[name]


@dataclass
class SourceStatement:
    """One statement (or expression) of a vime function, compiled from the checkout with its line."""

    path: Path
    lineno: int
    code: object  # a code object: exec for statements, eval for expressions

    def where(self) -> str:
        return f"{self.path.name}:{self.lineno}"


def source_statement(root: Path, relpath: str, function: str, match: Callable[[ast.AST], bool], *,
                     part: Callable[[ast.AST], ast.AST] | None = None) -> SourceStatement:
    """The first node of ``function`` (``Class.method`` allowed) for which ``match`` holds, compiled
    alone. ``part`` picks an expression of that node (e.g. an ``if``'s test) to compile for ``eval``;
    without it the statement itself is compiled for ``exec``."""
    path, tree = _parse_file(root, relpath)
    func = _find_function(tree, function, path)
    node = next((n for n in ast.walk(func) if match(n)), None)
    if node is None:
        raise VimeTreeError(f"{path}: {function} has no statement of the shape the conformance suite reads")
    if part is not None:
        code = compile(ast.Expression(body=part(node)), str(path), "eval")
    else:
        code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
    return SourceStatement(path=path, lineno=node.lineno, code=code)


def _assigns(name: str) -> Callable[[ast.AST], bool]:
    return lambda n: (isinstance(n, ast.Assign) and len(n.targets) == 1
                      and isinstance(n.targets[0], ast.Name) and n.targets[0].id == name)


def _reads(name: str) -> Callable[[ast.AST], bool]:
    return lambda n: isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)


def _sets_args_attr(name: str) -> Callable[[ast.AST], bool]:
    return lambda n: (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Attribute)
                      and isinstance(n.targets[0].value, ast.Name) and n.targets[0].value.id == "args"
                      and n.targets[0].attr == name)


def _if_on_args_attr(name: str) -> Callable[[ast.AST], bool]:
    return lambda n: (isinstance(n, ast.If) and isinstance(n.test, ast.Attribute)
                      and isinstance(n.test.value, ast.Name) and n.test.value.id == "args" and n.test.attr == name)


# The attributes the actor's forward decision reads that vime_validate_args derives after parsing
# (validation as a whole needs the checkpoints and vime.data.checkpoint): the statements that set them.
VALIDATE_DERIVED = {
    "use_critic": _sets_args_attr("use_critic"),
    "use_routing_replay": _if_on_args_attr("use_rollout_routing_replay"),
}


def apply_validate_derivations(root: Path, args: Namespace) -> list[str]:
    """Run vime_validate_args's own statements that derive ``use_critic`` / ``use_routing_replay``."""
    where = []
    for match in VALIDATE_DERIVED.values():
        statement = source_statement(root, "vime/utils/arguments.py", "vime_validate_args", match)
        exec(statement.code, {}, {"args": args})  # noqa: S102 - the checkout's own statement
        where.append(statement.where())
    return where


@dataclass
class ForwardPlan:
    """Which log-prob forwards vime's actor runs for one rollout (``MegatronTrainRayActor.train_actor``)."""

    reuses_training_forward: bool  # can_reuse_log_probs_in_loss: old log-probs come from the loss's own forward
    extra_log_prob_forward: bool  # compute_log_prob(store_prefix="") inside timer("train")
    where: str


def actor_forward_plan(root: Path, args: Namespace, num_steps_per_rollout: int) -> ForwardPlan:
    """Evaluate vime's own decision against parsed ``args``: the ``can_reuse_log_probs_in_loss``
    assignment and the test of the ``if`` that guards the extra ``compute_log_prob``, both compiled
    from the checkout's actor.py (``num_microbatches`` holds one entry per training step)."""
    method = "MegatronTrainRayActor.train_actor"
    decision = source_statement(root, ACTOR_FILE, method, _assigns("can_reuse_log_probs_in_loss"))
    guard = source_statement(
        root, ACTOR_FILE, method,
        lambda n: isinstance(n, ast.If) and any(_reads("can_reuse_log_probs_in_loss")(m) for m in ast.walk(n.test)),
        part=lambda n: n.test)
    scope = {"self": Namespace(args=args), "num_microbatches": [1] * num_steps_per_rollout}
    exec(decision.code, {}, scope)  # noqa: S102 - the checkout's own statement
    extra = eval(guard.code, {}, scope)
    return ForwardPlan(reuses_training_forward=bool(scope["can_reuse_log_probs_in_loss"]),
                       extra_log_prob_forward=bool(extra),
                       where=f"{decision.where()} (decision), {guard.where()} (extra forward)")
