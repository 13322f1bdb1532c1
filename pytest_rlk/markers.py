"""Marker registry and the question "can this machine serve this test?" (plain functions)."""
from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePath

from pytest_rlk.schema import PlatformInfo

TIERS: tuple[str, ...] = ("op", "module", "e2e", "plugin")
PLATFORM_TAGS: tuple[str, ...] = ("h100", "h200", "a100", "gb200")
PLATFORM_NAMES = {"h100": "H100", "h200": "H200", "a100": "A100", "gb200": "GB200"}

# Model checkpoints the model markers need under --rlk-model-root, as directory names.
CHECKPOINT_DIRS: dict[str, tuple[str, ...]] = {
    "qwen3_4b": ("qwen3_4b", "Qwen3-4B"),
    "qwen3_30b_a3b": ("qwen3_30b_a3b", "Qwen3-30B-A3B"),
    "glm45_air": ("glm45_air", "GLM-4.5-Air"),
}

MARKERS: dict[str, str] = {
    "op": "tier: operator parity, invariance, bad input and benchmarks",
    "module": "tier: training step, vocab-parallel and vLLM drift checks",
    "e2e": "tier: end-to-end A/B runs",
    "plugin": "tier: the plugin's own tests (suites/plugin: plain-module and pytester tests)",
    "bench": "benchmark (timing) test",
    "bench_full": "a labelled-variant or long benchmark: a job of its own, selected only by a -m expression "
                  "that names bench_full (-m h200 or -m bench leaves it out; no -m runs it)",
    "exclusive_gpu": "times or measures the whole GPU outside a benchmark: where xdist workers share a GPU "
                     "(--rlk-workers-per-gpu > 1) it waits for the serial phase, alone on the node, as benchmarks do",
    "slow": "slow test",
    "vime": "needs a vime checkout (--rlk-vime-root)",
    "vime_fork": "needs a checkout of the RL-Align vime fork (--rlk-vime-fork-root)",
    "h100": "needs an NVIDIA H100 (several hardware markers on one test mean any of them)",
    "h200": "needs an NVIDIA H200",
    "a100": "needs an NVIDIA A100",
    "gb200": "needs an NVIDIA GB200",
    "gpu": "needs at least one CUDA GPU",
    "cpu": "runs on CPU (always servable)",
    "gpus(n)": "needs at least n CUDA GPUs",
    "gpu_mem(gb)": "needs at least gb GB (1e9 bytes) of memory per GPU",
    "qwen3_4b": "needs the Qwen3-4B checkpoint under --rlk-model-root",
    "qwen3_30b_a3b": "needs the Qwen3-30B-A3B checkpoint under --rlk-model-root",
    "glm45_air": "needs the GLM-4.5-Air checkpoint under --rlk-model-root",
    "moe": "exercises a mixture-of-experts model",
    "r3": "exercises rollout routing replay (R3)",
    "tiny": "uses a tiny random model built from a config (always servable)",
    "injected_fault(what)": "runs a deliberately wrong part (what: e.g. 'log-probs 1e-3 too high'): its metrics "
                            "are expected to fail their gate, and the run report keeps them apart from real cases",
}


def marker_lines() -> list[str]:
    """Lines for ``config.addinivalue_line("markers", ...)``."""
    return [f"{name}: {text}" for name, text in MARKERS.items()]


# pytest's ``-m`` grammar: names joined by and/or/not and parentheses; ``name(key=value, ...)``
# matches keyword arguments of a mark (quoted strings, numbers, True/False/None as values)
_EXPR_TOKEN = re.compile(r"""\s*(?:(?P<string>'[^']*'|"[^"]*")|(?P<punct>[()=,])|(?P<word>[\w:+\-.\[\]\\/]+))""")
_EXPR_KEYWORDS = frozenset({"and", "or", "not"})


def marker_expression_names(expression: str) -> list[str]:
    """The marker names a ``-m`` expression asks for, in order (keyword arguments aside).
    Stops at a character outside the grammar: pytest reports that syntax error itself."""
    names: list[str] = []
    pos, depth_in_args = 0, 0
    previous_was_name = False
    while pos < len(expression):
        match = _EXPR_TOKEN.match(expression, pos)
        if match is None or match.end() == pos:
            break
        pos = match.end()
        punct, word = match.group("punct"), match.group("word")
        if depth_in_args:  # inside name(...): keyword arguments, not marker names
            depth_in_args += {"(": 1, ")": -1}.get(punct, 0)
            previous_was_name = False
            continue
        if punct == "(" and previous_was_name:
            depth_in_args = 1
        elif word is not None and word not in _EXPR_KEYWORDS:
            names.append(word)
            previous_was_name = True
            continue
        previous_was_name = False
    return list(dict.fromkeys(names))


def leaves_out_bench_full(expression: str | None) -> bool:
    """Whether a ``-m`` expression leaves the ``bench_full`` tests out: any expression that does not
    name ``bench_full`` (a platform's nightly, ``-m bench``); without ``-m`` every test runs."""
    return bool(expression) and "bench_full" not in marker_expression_names(expression)


def registered_names(ini_marker_lines: Iterable[str]) -> set[str]:
    """``"gpus(n): needs ..."`` -> ``gpus``: the names of pytest's ``markers`` ini lines."""
    return {line.split(":", 1)[0].split("(", 1)[0].strip() for line in ini_marker_lines}


def unknown_marker_error(expression: str, registered: Iterable[str]) -> str | None:
    """A usage error for a ``-m`` expression that names an unregistered marker (it would select
    nothing, silently), naming the bad marker, the nearest registered ones and all of them."""
    known = sorted(set(registered))
    unknown = [name for name in marker_expression_names(expression) if name not in known]
    if not unknown:
        return None
    near = [n for name in unknown for n in difflib.get_close_matches(name, known, n=3)]
    hint = f" (nearest: {', '.join(dict.fromkeys(near))})" if near else ""
    plural = "s" if len(unknown) > 1 else ""
    return (f"-m {expression!r}: unknown marker{plural} {', '.join(repr(n) for n in unknown)}{hint}; "
            f"registered markers: {', '.join(known)}")


GPU_MARKS = ("gpu", "gpus", "gpu_mem")
HARDWARE_MARKS: tuple[str, ...] = (*PLATFORM_TAGS, "gpu", "cpu")


def runnable_on(marker_names: Iterable[str]) -> tuple[str, ...]:
    """The hardware marks of every platform a test with these markers can run on.

    ``-m h100`` then means "what this suite runs on an H100 node": the plugin adds these marks
    at collection, before pytest's ``-m`` filter. A test without hardware markers (or marked
    ``cpu``) runs anywhere: every mark. ``gpu``, ``gpus(n)``, ``gpu_mem(gb)``: every GPU platform
    and ``gpu``. Platform markers: those platforms and ``gpu`` (several mean any of them).
    """
    names = set(marker_names)
    platforms = tuple(t for t in PLATFORM_TAGS if t in names)
    if platforms:
        return (*platforms, "gpu")
    if names & set(GPU_MARKS):
        return (*PLATFORM_TAGS, "gpu")
    return HARDWARE_MARKS


def tier_of(path: PurePath, marker_names: Iterable[str]) -> str | None:
    """An explicit tier marker wins; else ``.../suites/<tier>/...``; else untiered (None)."""
    names = set(marker_names)
    explicit = [t for t in TIERS if t in names]
    if explicit:
        return explicit[0]
    parts = path.parts
    for i, part in enumerate(parts[:-1]):
        if part == "suites" and parts[i + 1] in TIERS:
            return parts[i + 1]
    return None


def tier_of_dir(path: PurePath) -> str | None:
    """The tier a directory ``.../suites/<tier>`` stands for (None for any other directory)."""
    parts = path.parts
    if len(parts) >= 2 and parts[-2] == "suites" and parts[-1] in TIERS:
        return parts[-1]
    return None


@dataclass
class ServeContext:
    """What the machine and the options offer, for :func:`unserved_reason`."""

    platform: PlatformInfo
    vime_root: Path | None = None
    model_root: Path | None = None
    extra: dict[str, object] = field(default_factory=dict)


def _a(name: str) -> str:
    return ("an " if name[0] in "AEFHILMNORSX" else "a ") + name


def _int_arg(name: str, args: tuple) -> float:
    if len(args) != 1 or not isinstance(args[0], (int, float)) or args[0] < 0:
        raise ValueError(f"marker {name} takes one non-negative number, got {args!r}")
    return args[0]


def unserved_reason(marks: Iterable[tuple[str, tuple]], ctx: ServeContext) -> str | None:
    """Why this machine cannot serve a test with these ``(name, args)`` marks; None if it can.

    Every unmet requirement is named, joined with "; ".
    """
    marks = list(marks)
    names = [n for n, _ in marks]
    plat = ctx.platform
    reasons: list[str] = []

    wanted = [t for t in PLATFORM_TAGS if t in names]
    if wanted and plat.tag not in wanted:
        needed = " or ".join(PLATFORM_NAMES[t] for t in wanted)
        reasons.append(f"needs {_a(needed)} (this machine: {plat.describe()})")
    if "gpu" in names and plat.device_count < 1:
        reasons.append(f"needs a GPU (this machine: {plat.describe()})")
    for name, args in marks:
        if name == "gpus":
            n = _int_arg(name, args)
            if plat.device_count < n:
                reasons.append(f"needs {n:g} GPUs (found {plat.device_count})")
        elif name == "gpu_mem":
            gb = _int_arg(name, args)
            have = plat.memory_bytes / 1e9
            if have < gb:
                reasons.append(f"needs {gb:g} GB GPU memory (found {have:.0f})")
    for model, dirs in CHECKPOINT_DIRS.items():
        if model not in names:
            continue
        if ctx.model_root is None:
            reasons.append(f"needs checkpoint {model} under --rlk-model-root (not given)")
        elif not any((ctx.model_root / d).is_dir() for d in dirs):
            reasons.append(
                f"needs checkpoint {model} under --rlk-model-root "
                f"(none of {', '.join(dirs)} in {ctx.model_root})"
            )
    if "vime" in names and ctx.vime_root is None:
        reasons.append("needs a vime checkout (--rlk-vime-root not given)")
    return "; ".join(reasons) if reasons else None
