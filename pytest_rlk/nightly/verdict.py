"""One verdict over the runs of several platforms (``rlk verdict RUN...``).

Each run is gated against its own platform's baselines (``baselines/<tier>/<platform>/``) by the
comparison engine, exactly as ``rlk diff RUN`` does; the runs of one platform (several nodes of a
kind) share a column. The verdict fails on any of:

- a platform expected (by the plan, or ``--expect``) with no run: ``absent``;
- a node that did not complete (died, timed out, no answer, unschedulable, not started): ``node``;
- a run that did not end normally (crashed, interrupted, still running) or whose pytest exited
  with a usage/internal error or collected nothing: ``run``;
- a node whose run reports another platform than the plan expects: ``platform_mismatch``;
- a failed or erroring test: ``failed``; a gated metric outside its band (or a metric the
  baseline has that the run did not record): ``regression``;
- an unreadable baseline: ``baseline_error``; with ``require_baselines``, a missing one:
  ``missing_baseline``.

Improvements beyond the refresh band, new and no-longer-gated metrics are notes, not failures
(``fail_on_improvement`` makes improvements problems).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field

from pytest_rlk import storage
from pytest_rlk.cli import diff_against_baselines
from pytest_rlk.manifest import utc_now
from pytest_rlk.nightly.plan import NIGHTLY_FILE, NodeOutcome, load_nightly
from pytest_rlk.schema import GateResult, RunRecord, TestRecord, Verdict, _Strict
from pytest_rlk.table import fmt

VERDICT_SCHEMA_VERSION = 1
ProblemKind = Literal["absent", "node", "run", "platform_mismatch", "failed", "regression",
                      "baseline_error", "missing_baseline", "improved"]
_OK_EXIT_STATUSES = (0, 1)  # pytest: all passed / some tests failed (those are named one by one)
NOT_RUN = "-"


class Problem(_Strict):
    kind: ProblemKind
    platform: str | None = None
    node: str | None = None
    nodeid: str | None = None
    message: str

    def line(self) -> str:
        where = self.platform or "?"
        if self.node:
            where += f" (node {self.node})"
        test = f" {self.nodeid}:" if self.nodeid else ""
        return f"{where}: {self.kind}:{test} {self.message}"


class PlatformColumn(_Strict):
    platform: str
    expected: bool
    nodes: list[str] = Field(default_factory=list)
    runs: list[str] = Field(default_factory=list)
    run_statuses: list[str] = Field(default_factory=list)
    outcomes: dict[str, int] = Field(default_factory=dict)
    gate: dict[str, int] = Field(default_factory=dict)
    problems: int = 0

    @property
    def ok(self) -> bool:
        return self.problems == 0


class VerdictRow(_Strict):
    nodeid: str
    cells: dict[str, str]  # platform -> what happened there


class VerdictRecord(_Strict):
    """``verdict.json``."""

    schema_version: int = VERDICT_SCHEMA_VERSION
    created_utc: str
    baselines: str
    expected_platforms: list[str]
    columns: list[PlatformColumn]
    problems: list[Problem]
    notes: list[str] = Field(default_factory=list)
    rows: list[VerdictRow] = Field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass
class RunInput:
    run_dir: Path
    run: RunRecord
    node: str
    expected_platform: str | None = None  # what the plan says this node is


@dataclass
class VerdictInputs:
    runs: list[RunInput] = field(default_factory=list)
    nodes: list[NodeOutcome] = field(default_factory=list)  # from nightly directories
    expected: list[str] = field(default_factory=list)


def collect_inputs(args: list[str | Path], *, expect: list[str] | None = None) -> VerdictInputs:
    """Run directories (or run.json files), and nightly directories (their plan's platforms are
    expected, their nodes' outcomes and runs are read)."""
    inputs = VerdictInputs(expected=list(expect or []))
    for arg in args:
        path = Path(arg)
        if (path / NIGHTLY_FILE).is_file():
            nightly = load_nightly(path)
            inputs.expected += nightly.plan.expected_platforms
            for spec in nightly.plan.nodes:
                outcome = nightly.nodes.get(spec.name) or NodeOutcome(
                    name=spec.name, platform=spec.platform, status="no_answer",
                    detail="the nightly recorded nothing for this node (did its driver stop early?)")
                inputs.nodes.append(outcome)
                if outcome.run_dir:
                    run_dir = path / outcome.run_dir
                    inputs.runs.append(RunInput(run_dir, storage.load_run(run_dir / storage.RUN_FILE),
                                                node=spec.name, expected_platform=spec.platform))
            continue
        run_file = storage.resolve_run_file(path)
        run = storage.load_run(run_file)
        inputs.runs.append(RunInput(run_file.parent, run, node=run.host or run_file.parent.name))
    inputs.expected = list(dict.fromkeys(inputs.expected))
    return inputs


@dataclass
class _Gated:
    test: TestRecord
    result: GateResult | None


def _gate_run(item: RunInput, baselines: Path, refresh_rel: float | None,
              problems: list[Problem]) -> dict[str, _Gated]:
    """Every test of the run by nodeid, with its gate result against the platform's baselines."""
    run = item.run
    gated_tests = [t for t in run.tests if any(m.gate for m in t.metrics)]
    try:
        results = diff_against_baselines(run, baselines, refresh_rel=refresh_rel)
    except (storage.RlkFileError, ValueError) as exc:
        problems.append(Problem(kind="baseline_error", platform=run.manifest.platform.tag, node=item.node,
                                message=str(exc)))
        results = [None] * len(gated_tests)
    by_test = {id(t): r for t, r in zip(gated_tests, results, strict=True)}
    return {t.nodeid: _Gated(t, by_test.get(id(t))) for t in run.tests}


def _comparison_text(result: GateResult, verdicts: tuple[Verdict, ...]) -> str:
    return "; ".join(
        f"{c.name}: {c.verdict.label}: baseline {fmt(c.baseline)}, new {fmt(c.new)}"
        + (f" ({c.detail})" if c.detail else "")
        for c in result.comparisons if c.verdict in verdicts)


def _cell(gated: _Gated) -> str:
    test, result = gated.test, gated.result
    if result is None or not result.comparisons:
        return test.outcome
    counts = Counter(c.verdict for c in result.comparisons)
    bad = [c.name for c in result.regressions]
    if bad:
        return f"{test.outcome}, regression: {', '.join(bad)}"
    shown = ", ".join(f"{n} {v.value}" for v, n in sorted(counts.items(), key=lambda kv: kv[0].value))
    return f"{test.outcome} ({shown})"


def _tests(n: int) -> str:
    return "1 test" if n == 1 else f"{n} tests"


def _first_line(text: str | None) -> str:
    return (text or "(no message recorded)").strip().splitlines()[0]


def build_verdict(inputs: VerdictInputs, baselines: Path, *, refresh_rel: float | None = None,
                  require_baselines: bool = False, fail_on_improvement: bool = False) -> VerdictRecord:
    problems: list[Problem] = []
    notes: list[str] = []
    columns: dict[str, PlatformColumn] = {}
    cells: dict[str, dict[str, list[str]]] = {}  # nodeid -> platform -> cell texts

    def column(platform: str) -> PlatformColumn:
        if platform not in columns:
            columns[platform] = PlatformColumn(platform=platform, expected=platform in inputs.expected)
        return columns[platform]

    for platform in inputs.expected:
        column(platform)
    troubled = set()  # nodes that did not complete: their runs' state is part of that problem
    run_state = {item.node: f" ({item.run.status}, {_tests(len(item.run.tests))})" for item in inputs.runs}
    for node in inputs.nodes:
        col = column(node.platform)
        if node.name not in col.nodes:
            col.nodes.append(node.name)
        if node.status != "completed":
            troubled.add(node.name)
            kept = (f"; partial run kept: {node.run_dir}{run_state.get(node.name, '')}" if node.run_dir
                    else "; no run files arrived")
            problems.append(Problem(kind="node", platform=node.platform, node=node.name,
                                    message=f"{node.status}: {node.detail}{kept}"))
        elif node.run_dir is None:
            problems.append(Problem(kind="run", platform=node.platform, node=node.name,
                                    message=f"pytest exited with status {node.exit_status} and started no run "
                                            "(a usage error?): see the node's pytest.log"))

    several = Counter(item.run.manifest.platform.tag for item in inputs.runs)
    for item in inputs.runs:
        run = item.run
        platform = run.manifest.platform.tag
        col = column(platform)
        if item.node not in col.nodes:
            col.nodes.append(item.node)
        col.runs.append(str(item.run_dir))
        col.run_statuses.append(run.status)
        if item.expected_platform is not None and item.expected_platform != platform:
            problems.append(Problem(kind="platform_mismatch", platform=platform, node=item.node,
                                    message=f"the plan expects platform {item.expected_platform!r} on this node; "
                                            f"its run reports {platform!r} ({run.manifest.platform.describe()})"))
        if run.status != "complete" and item.node not in troubled:
            problems.append(Problem(kind="run", platform=platform, node=item.node,
                                    message=f"run {item.run_dir} is {run.status} ({_tests(len(run.tests))} recorded)"))
        elif run.status == "complete" and run.exit_status not in _OK_EXIT_STATUSES:
            problems.append(Problem(kind="run", platform=platform, node=item.node,
                                    message=f"run {item.run_dir}: pytest exit status {run.exit_status} (usage or "
                                            "internal error, or no tests collected)"))
        for nodeid, gated in _gate_run(item, baselines, refresh_rel, problems).items():
            test, result = gated.test, gated.result
            col.outcomes[test.outcome] = col.outcomes.get(test.outcome, 0) + 1
            text = _cell(gated) + (f" [{item.node}]" if several[platform] > 1 else "")
            if result is not None:
                for c in result.comparisons:
                    col.gate[c.verdict.value] = col.gate.get(c.verdict.value, 0) + 1
            if result is not None and result.failing:  # shadow mode: a non-finite value only
                problems.append(Problem(kind="regression", platform=platform, node=item.node, nodeid=nodeid,
                                        message=_comparison_text(result, (Verdict.REGRESSION, Verdict.MISSING_METRIC))))
            elif test.outcome in ("failed", "error"):
                problems.append(Problem(kind="failed", platform=platform, node=item.node, nodeid=nodeid,
                                        message=f"{test.outcome}: {_first_line(test.failure)}"))
            if result is not None and result.improvements:
                message = _comparison_text(result, (Verdict.IMPROVED,))
                if fail_on_improvement:
                    problems.append(Problem(kind="improved", platform=platform, node=item.node, nodeid=nodeid,
                                            message=message))
                else:
                    notes.append(f"{platform} (node {item.node}): {nodeid}: {message}")
            if result is not None and result.missing_baseline:
                if require_baselines:
                    problems.append(Problem(kind="missing_baseline", platform=platform, node=item.node,
                                            nodeid=nodeid, message=f"no baseline at {result.baseline_path}"))
            for c in (result.with_verdict(Verdict.NEW_METRIC, Verdict.UNGATED) if result else []):
                notes.append(f"{platform} (node {item.node}): {nodeid}: {c.name}: {c.verdict.label}")
            if test.outcome != "passed" or test.metrics or result is not None:
                cells.setdefault(nodeid, {}).setdefault(platform, []).append(text)

    for platform in inputs.expected:
        if not columns[platform].runs:
            problems.append(Problem(kind="absent", platform=platform,
                                    message="expected, but no run of this platform was given"
                                            + (" (its node produced none)" if columns[platform].nodes else "")))
    missing = sum(v for col in columns.values() for k, v in col.gate.items() if k == Verdict.MISSING_BASELINE.value)
    if missing and not require_baselines:
        notes.append(f"{missing} gated metrics have no baseline (not a failure without require_baselines)")
    for p in problems:
        if p.platform in columns:
            columns[p.platform].problems += 1
    order = list(inputs.expected) + sorted(set(columns) - set(inputs.expected))
    rows = [VerdictRow(nodeid=nodeid, cells={p: " / ".join(texts) for p, texts in by_platform.items()})
            for nodeid, by_platform in sorted(cells.items())]
    return VerdictRecord(created_utc=utc_now(), baselines=str(baselines), expected_platforms=list(inputs.expected),
                         columns=[columns[p] for p in order], problems=problems, notes=notes, rows=rows)
