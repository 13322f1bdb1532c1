"""Parser of vime's stdout metric lines (the primary metric source of a vime run).

vime logs every metric dict as a Python dict repr on one line (vime-facts.md, "Metrics"):

    [2026-11-22 07:00:00] train_metric_utils.py:135 - rollout 3: {'rollout/raw_reward': np.float64(0.5), ...}

(vime's logging format, `[date time<prefix>] file:line - message`, the prefix e.g. ` fully-async-0`.)
Under Ray the line is preceded by `(ActorName pid=N) ` (sometimes with `, ip=...`), possibly with
ANSI colours, and Ray may append `[repeated 3x across cluster]`. Kinds: `rollout N` (the trainer's
rollout data), `step N` (the trainer's global step; `critic-step N` is kept apart, never mixed into
the actor's series), `perf N` (two lines per rollout, merged by key: the trainer's, with
`perf/train_time`, and the rollout manager's, with `perf/rollout_time`; the latter is not printed
when the arm replays recorded rollouts, `--load-debug-rollout-data`) and `eval N`.
Values may print as `np.float64(x)`; `nan`/`inf` print bare.

vime's metric sets differ between rollouts (e.g. `perf/update_weights_time` from the second rollout
on) and between lanes: `series` keeps a metric missing at some rollouts as NaN gaps, `gaps` names
them, and `missing_lines` lists the expected lines that never came. Whether a gap matters is the
gate's business (a gated metric's gap is a problem of the arm; the engine decides).

A line that cannot be read is kept as a `MalformedLine` (never silently dropped): a `KIND N: ...` line
whose dict does not parse, and a line that starts like one (`KIND N` behind the prefixes) and carries a
dict but is not of the form `KIND N: {...}` (e.g. `step 1 warning: ... {'x': <object at 0x7f>}`).
`VimeLog.unreadable()` gives their count and the first few; `parse_vime_log(..., strict=True)` raises
on the first one instead.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pytest_rlk.e2e import metrics as m

# vime key -> canonical e2e metric name (pytest_rlk.e2e.metrics).
VIME_KEY_MAP: dict[str, str] = {
    "rollout/raw_reward": m.RAW_REWARD,
    "rollout/response_lengths": m.RESPONSE_LENGTH,
    "rollout/log_probs": m.LOG_PROBS,
    "rollout/rollout_log_probs": m.ROLLOUT_LOG_PROBS,
    "rollout/kl": m.ROLLOUT_KL,
    "train/loss": m.LOSS,
    "train/pg_loss": m.PG_LOSS,
    "train/pg_clipfrac": m.PG_CLIPFRAC,
    "train/ppo_kl": m.PPO_KL,
    "train/kl_loss": m.KL_LOSS,
    "train/entropy_loss": m.ENTROPY_LOSS,
    "train/train_rollout_logprob_abs_diff": m.ABS_DIFF,
    "train/grad_norm": m.GRAD_NORM,
    "perf/rollout_time": m.ROLLOUT_TIME,
    "perf/log_probs_time": m.LOG_PROBS_TIME,
    "perf/ref_log_probs_time": m.REF_LOG_PROBS_TIME,
    "perf/actor_train_time": m.ACTOR_TRAIN_TIME,
    "perf/train_time": m.TRAIN_TIME,
    # Weight sync after rollout N-1 is reported in rollout N's perf line.
    "perf/update_weights_time": m.UPDATE_WEIGHTS_TIME,
    "perf/step_time": m.STEP_TIME,
    "perf/tokens_per_gpu_per_sec": m.TOKENS_PER_GPU_PER_S,
    "perf/actor_train_tok_per_s": m.TRAIN_TOKENS_PER_S,
    # The fork's counter and our custom loss's `rlk_fallback` (logged by vime under train/).
    "train/rl_kernel_fallback_count": m.FALLBACK_COUNT,
    "train/rlk_fallback": m.FALLBACK_COUNT,
}

# Evidence lines of a fallback: the fork's provider path (its WARNING when a provider is unavailable),
# our dispatcher's WARNING and the vime adapter's (a configuration handed to vime's loss).
FALLBACK_LINE = re.compile(
    r"Falling back to vime logprob path because RL-Kernel \S+ is unavailable|"
    r"linear_logp provider \S+ is unavailable; using native path|"
    r"kernels: \S+ falls back to reference:|"
    r"kernels: \S+ falls back to vime's native loss:"
)
PROVIDER_ACTIVE_LINE = re.compile(r"linear_logp provider active:")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAY_PREFIX = re.compile(r"^\s*\([A-Za-z_][\w.:-]*(?: pid=\d+)?(?:, ip=[\w.:-]+)?\)\s*")
_RAY_REPEAT = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")
_LOG_PREFIX = re.compile(r"^\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?: [^\]]*)?\]\s+[\w./-]+:\d+\s+-\s+")
_METRIC_LINE = re.compile(r"^(rollout|step|critic-step|perf|eval) (-?\d+): (.*)$")
# Starts like a metric line and carries a dict, whatever comes between: announces metrics it may not hold.
_METRIC_LIKE = re.compile(r"^(rollout|step|critic-step|perf|eval) (-?\d+)\b.*\{")
# How many unreadable lines `VimeLog.unreadable` quotes (the count covers all of them).
UNREADABLE_QUOTED = 3
_NUMPY_SCALARS = frozenset({"float64", "float32", "float16", "int64", "int32", "bool_"})
KINDS: tuple[str, ...] = ("rollout", "step", "critic-step", "perf", "eval")
# Keys that identify each perf line of a rollout (the two lines merge by key).
TRAINER_PERF_KEY = "perf/train_time"
ROLLOUT_MANAGER_PERF_KEY = "perf/rollout_time"
# Present from the second rollout on (no weight sync before the first rollout): not a gap.
_LATE_KEYS = frozenset({"perf/update_weights_time"})


class VimeLogError(ValueError):
    """A malformed metric line under strict parsing (names the line number and the reason)."""


@dataclass(frozen=True)
class MalformedLine:
    lineno: int
    text: str
    reason: str

    def describe(self) -> str:
        return f"line {self.lineno}: {self.reason}: {self.text[:200]}"


@dataclass
class VimeLog:
    """Metric dicts by kind and index, with everything that could not be read."""

    records: dict[str, dict[int, dict[str, float]]] = field(
        default_factory=lambda: {kind: {} for kind in KINDS}
    )
    malformed: list[MalformedLine] = field(default_factory=list)
    fallback_lines: list[str] = field(default_factory=list)
    provider_active_lines: list[str] = field(default_factory=list)
    lines_read: int = 0

    def unreadable(self, first: int = UNREADABLE_QUOTED) -> dict:
        """Every line that could not be read: ``{"count": n, "first": [line N: reason: text, ...]}``."""
        return {"count": len(self.malformed), "first": [bad.describe() for bad in self.malformed[:first]]}

    @property
    def rollout_ids(self) -> list[int]:
        ids = set(self.records["rollout"]) | set(self.records["perf"])
        return sorted(ids)

    def _by_rollout(self, steps_per_rollout: int) -> dict[int, dict[str, list[float]]]:
        if steps_per_rollout < 1:
            raise ValueError(f"steps_per_rollout must be >= 1, got {steps_per_rollout}")
        by_rollout: dict[int, dict[str, list[float]]] = {}
        for kind in ("rollout", "perf"):
            for rid, values in self.records[kind].items():
                slot = by_rollout.setdefault(rid, {})
                for key, value in values.items():
                    slot.setdefault(key, []).append(value)
        for step, values in self.records["step"].items():
            slot = by_rollout.setdefault(step // steps_per_rollout, {})
            for key, value in values.items():
                slot.setdefault(key, []).append(value)
        rollouts = sorted(by_rollout)
        if rollouts and rollouts != list(range(rollouts[0], rollouts[0] + len(rollouts))):
            raise VimeLogError(f"rollout ids are not contiguous: {rollouts}")
        return by_rollout

    def series(self, steps_per_rollout: int = 1) -> m.ArmSeries:
        """Canonical per-rollout series; train steps are averaged within their rollout.

        `step N` lines are the trainer's global step: rollout = N // steps_per_rollout. Series stay
        aligned with the rollout index: a metric missing at some rollout holds NaN there (`gaps` names
        them), except keys that start late (`perf/update_weights_time`), whose series start at their
        first value.
        """
        by_rollout = self._by_rollout(steps_per_rollout)
        rollouts = sorted(by_rollout)
        out: m.ArmSeries = {}
        names: dict[str, str] = {}
        for rid in rollouts:
            for key in by_rollout[rid]:
                names.setdefault(key, VIME_KEY_MAP.get(key, key))
        for key, name in names.items():
            column: list[float] = []
            for rid in rollouts:
                values = by_rollout[rid].get(key)
                if values is None:
                    if key in _LATE_KEYS and not column:
                        continue
                    column.append(math.nan)
                else:
                    column.append(math.fsum(values) / len(values))
            if name in out:  # two vime keys for one canonical metric (fallback counters)
                out[name] = [_nanmax(a, b) for a, b in zip(out[name], column, strict=True)]
            else:
                out[name] = column
        return out

    def gaps(self, steps_per_rollout: int = 1) -> dict[str, list[int]]:
        """Canonical metric -> the rollouts it is missing at (metrics present at some rollouts only)."""
        by_rollout = self._by_rollout(steps_per_rollout)
        out: dict[str, set[int]] = {}
        keys = {key for slot in by_rollout.values() for key in slot}
        for key in keys:
            present = [rid for rid in sorted(by_rollout) if key in by_rollout[rid]]
            start = present[0] if key in _LATE_KEYS else min(by_rollout)
            missing = [rid for rid in sorted(by_rollout) if rid >= start and key not in by_rollout[rid]]
            if missing:
                out.setdefault(VIME_KEY_MAP.get(key, key), set()).update(missing)
        return {name: sorted(rids) for name, rids in sorted(out.items())}

    def missing_lines(self, steps_per_rollout: int = 1, *, replays_rollouts: bool = False) -> list[str]:
        """The metric lines vime prints for every rollout that this log lacks, one entry per kind of
        line: the trainer's `rollout N` line, its `step` lines, the trainer's `perf` line and (unless the
        arm replays recorded rollouts, where vime prints none) the rollout manager's `perf` line."""
        rollouts = sorted(self._by_rollout(steps_per_rollout))
        if not rollouts:
            return []
        expected = {
            "trainer 'rollout N' line": lambda rid: rid in self.records["rollout"],
            f"{steps_per_rollout} trainer 'step' line(s)": lambda rid: all(
                rid * steps_per_rollout + k in self.records["step"] for k in range(steps_per_rollout)),
            f"trainer 'perf N' line ({TRAINER_PERF_KEY})": lambda rid: TRAINER_PERF_KEY in self.records["perf"].get(rid, {}),
        }
        if not replays_rollouts:
            expected[f"rollout manager 'perf N' line ({ROLLOUT_MANAGER_PERF_KEY})"] = (
                lambda rid: ROLLOUT_MANAGER_PERF_KEY in self.records["perf"].get(rid, {}))
        out = []
        for what, present in expected.items():
            missing = [rid for rid in rollouts if not present(rid)]
            if missing:
                out.append(f"{what} missing at rollouts {_ranges(missing)}")
        return out


def _nanmax(a: float, b: float) -> float:
    if math.isnan(a):
        return b
    return a if math.isnan(b) else max(a, b)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, rid in enumerate(ids):
        if start is None:
            start = rid
        if i + 1 == len(ids) or ids[i + 1] != rid + 1:
            parts.append(str(start) if start == rid else f"{start}-{rid}")
            start = None
    return ", ".join(parts)


def _strip(line: str) -> str:
    line = _ANSI.sub("", line.rstrip("\r\n"))
    line = _RAY_PREFIX.sub("", line, count=1)
    line = _RAY_REPEAT.sub("", line)
    return _LOG_PREFIX.sub("", line, count=1)


def _literal(node: ast.AST) -> object:
    """Evaluate the subset of Python a vime metric dict prints: numbers, strings, bools, None,
    lists/tuples, negation, `nan`/`inf`, and numpy scalar reprs like `np.float64(1.5)`."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in ("nan", "inf"):
        return float(node.id)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in ("np", "numpy")
        and node.func.attr in _NUMPY_SCALARS
        and len(node.args) == 1
        and not node.keywords
    ):
        return _literal(node.args[0])
    raise ValueError(f"unsupported expression {ast.dump(node)[:80]}")


def parse_metric_dict(text: str) -> dict[str, float]:
    """`{'a/b': np.float64(1.0), ...}` -> {'a/b': 1.0}; raises ValueError naming the problem."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not a Python dict ({exc.msg})") from None
    if not isinstance(tree.body, ast.Dict):
        raise ValueError("not a dict")
    out: dict[str, float] = {}
    for key_node, value_node in zip(tree.body.keys, tree.body.values, strict=True):
        if key_node is None:
            raise ValueError("dict unpacking is not a metric")
        key = _literal(key_node)
        if not isinstance(key, str):
            raise ValueError(f"non-string key {key!r}")
        value = _literal(value_node)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"key {key!r}: non-numeric value {value!r}")
        out[key] = float(value)
    return out


def metric_line(raw: str) -> tuple[str, int, str] | None:
    """(kind, index, dict text) of a metric line (`rollout 3: {...}` behind any prefix), else None."""
    match = _METRIC_LINE.match(_strip(raw))
    return (match.group(1), int(match.group(2)), match.group(3)) if match else None


def parse_vime_lines(lines: Iterable[str], *, strict: bool = False) -> VimeLog:
    log = VimeLog()
    for lineno, raw in enumerate(lines, start=1):
        log.lines_read = lineno
        line = _strip(raw)
        if FALLBACK_LINE.search(line):
            log.fallback_lines.append(line)
        if PROVIDER_ACTIVE_LINE.search(line):
            log.provider_active_lines.append(line)
        match = _METRIC_LINE.match(line)
        if not match:
            like = _METRIC_LIKE.match(line)
            if like:
                bad = MalformedLine(lineno, raw.rstrip("\r\n"), f"{like.group(1)} {like.group(2)}: starts like a metric "
                                    f"line but is not of the form '{like.group(1)} N: {{...}}'")
                if strict:
                    raise VimeLogError(bad.describe())
                log.malformed.append(bad)
            continue
        kind, index, body = match.group(1), int(match.group(2)), match.group(3)
        try:
            values = parse_metric_dict(body)
        except ValueError as exc:
            bad = MalformedLine(lineno, raw.rstrip("\r\n"), f"{kind} {index}: {exc}")
            if strict:
                raise VimeLogError(bad.describe()) from None
            log.malformed.append(bad)
            continue
        slot = log.records[kind].setdefault(index, {})
        conflicts = [k for k, v in values.items() if k in slot and slot[k] != v]
        if conflicts:
            bad = MalformedLine(lineno, raw.rstrip("\r\n"),
                                f"{kind} {index}: conflicting values for {conflicts} across lines")
            if strict:
                raise VimeLogError(bad.describe())
            log.malformed.append(bad)
            continue
        slot.update(values)  # the two perf lines of a rollout merge by key
    return log


def parse_vime_log(path: str | Path, *, strict: bool = False) -> VimeLog:
    path = Path(path)
    with path.open(encoding="utf-8", errors="replace") as fh:
        try:
            return parse_vime_lines(fh, strict=strict)
        except VimeLogError as exc:
            raise VimeLogError(f"{path}: {exc}") from None
