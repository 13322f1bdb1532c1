"""``rlk diff RUN --a-tag K=V --b-tag K=V``: two tag selections of ONE run, e.g. two backends.

Every metric of the run (gated or not) whose tags match a side's selectors belongs to that side.
Metrics pair by name plus all their tags except the selecting keys and ``backend_version``; the
pairs go through the same engine as every diff (:func:`pytest_rlk.compare.compare_records`, A is
the reference; the band is the metric's own, else the default of ``pytest_rlk.bands``). A pair
present on one side only is ``new_metric`` (only in B) or ``missing_metric`` (only in A), unless
that side's backend does not support it: its counterpart test (the same test, with the other
side's selector value in the parameter id, e.g. ``test_logp[liger-bf16-...]`` for
``test_logp[rlk-triton-bf16-...]``) skipped with a backend-capability reason
(``pytest_rlk.skips``). Then its metrics are ``unsupported``: named once per backend under the
table (:func:`unsupported_lines`), never a failure.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from pytest_rlk.compare import compare_records
from pytest_rlk.options import OptionError
from pytest_rlk.schema import GateResult, MetricRecord, RunRecord, TestRecord, Verdict
from pytest_rlk.skips import CAPABILITY, skip_cause

IGNORED_TAGS = ("backend_version",)  # the same backend at another version still pairs

Selector = dict[str, str]
PairKey = tuple[tuple[str, str], ...]  # the remaining tags, sorted


def parse_selectors(items: Sequence[str], option: str) -> Selector:
    """``["backend=rlk-triton", "dtype=bf16"]`` -> dict; bad items name the option."""
    selector: Selector = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise OptionError(f"{option} {item!r}: expected KEY=VALUE (e.g. backend=rlk-triton)")
        if key in selector and selector[key] != value:
            raise OptionError(f"{option}: tag {key!r} given twice ({selector[key]!r}, {value!r})")
        selector[key] = value
    return selector


def selector_text(selector: Selector) -> str:
    return ",".join(f"{k}={v}" for k, v in selector.items())


def check_matches(run: RunRecord, selector: Selector, option: str) -> None:
    """A selection that matches no metric of the run is an error naming the tag and what the run
    holds instead (the tag keys, or the key's values), never a table of missing metrics."""
    tags = [m.tags for t in run.tests for m in t.metrics]
    if any(all(tg.get(k) == v for k, v in selector.items()) for tg in tags):
        return
    for key, value in selector.items():
        values = sorted({tg[key] for tg in tags if key in tg})
        if not values:
            keys = sorted({k for tg in tags for k in tg})
            raise OptionError(f"{option} {key}={value} matches no metric of this run; its tags: "
                              f"{', '.join(keys) or '(none)'}")
        if value not in values:
            raise OptionError(f"{option} {key}={value} matches no metric of this run; values of "
                              f"{key!r} in it: {', '.join(values)}")
    raise OptionError(f"{option} {selector_text(selector)}: each tag matches metrics, but no metric has all of them")


def _side(run: RunRecord, selector: Selector, drop: set[str], label: str
          ) -> tuple[dict[PairKey, dict[str, MetricRecord]], dict[PairKey, list[str]]]:
    """The side's metrics by pair key, and the tests (node ids) that recorded each group."""
    groups: dict[PairKey, dict[str, MetricRecord]] = {}
    sources: dict[PairKey, list[str]] = {}
    where: dict[tuple[PairKey, str], str] = {}
    for test in run.tests:
        for m in test.metrics:
            if any(m.tags.get(k) != v for k, v in selector.items()):
                continue
            key = tuple(sorted((k, v) for k, v in m.tags.items() if k not in drop))
            group = groups.setdefault(key, {})
            if m.name in group:
                raise OptionError(
                    f"side {label}: metric {m.name!r} with tags {dict(key)} is recorded by both "
                    f"{where[key, m.name]} and {test.nodeid}; add a tag that tells them apart")
            group[m.name] = m
            where[key, m.name] = test.nodeid
            if test.nodeid not in sources.setdefault(key, []):
                sources[key].append(test.nodeid)
    return groups, sources


def counterpart_nodeid(nodeid: str, value: str, other: str) -> str | None:
    """``test_logp[rlk-triton-bf16]`` with ``rlk-triton`` -> ``liger``: ``test_logp[liger-bf16]``
    (the value as a whole part of the parameter id); None when the id does not hold the value."""
    head, bracket, params = nodeid.partition("[")
    if not bracket:
        return None
    pattern = re.compile(rf"(?<![^\[\-_]){re.escape(value)}(?![^\]\-_])")
    swapped, n = pattern.subn(other, bracket + params, count=1)
    return head + swapped if n else None


def _unsupported_reason(tests: dict[str, TestRecord], nodeids: Sequence[str], here: Selector,
                        there: Selector) -> str | None:
    """The capability skip reason of the other side's counterpart of these tests, if any."""
    changed = [(k, here[k], there[k]) for k in here if k in there and here[k] != there[k]]
    for nodeid in nodeids:
        for _, value, other in changed:
            twin = tests.get(counterpart_nodeid(nodeid, value, other) or "")
            if twin is not None and twin.outcome == "skipped" and skip_cause(twin) == CAPABILITY:
                return twin.skip_reason
    return None


def _mark_not_returned(result: GateResult, verdict: Verdict, side: str, tests: dict[str, TestRecord],
                       nodeids: Sequence[str]) -> None:
    """A metric the side's tests, which passed, did not record: its backend does not return it
    (the test's contract lets a backend leave it out)."""
    if not all(tests[n].outcome == "passed" for n in nodeids):
        return  # a failed test may have stopped before recording it: missing, not unsupported
    for c in result.comparisons:
        if c.verdict is verdict:
            c.verdict, c.detail = Verdict.UNSUPPORTED, f"{side}: returns no {c.name} (its tests pass without it)"


def _mark_unsupported(result: GateResult, verdict: Verdict, side: str, reason: str) -> None:
    for c in result.comparisons:
        if c.verdict is verdict:
            c.verdict, c.detail = Verdict.UNSUPPORTED, f"{side}: {reason}"


def diff_tag_selections(run: RunRecord, a: Selector, b: Selector, *,
                        refresh_rel: float | None = None) -> list[GateResult]:
    """One GateResult per group of remaining tags (its case reads ``k=v,k=v``), A as reference."""
    if not a or not b:
        raise OptionError("--a-tag and --b-tag go together: give both (KEY=VALUE each)")
    if a == b:
        raise OptionError(f"--a-tag and --b-tag select the same metrics ({a})")
    check_matches(run, a, "--a-tag")
    check_matches(run, b, "--b-tag")
    drop = set(a) | set(b) | set(IGNORED_TAGS)
    a_groups, a_sources = _side(run, a, drop, "A")
    b_groups, b_sources = _side(run, b, drop, "B")
    tests = {t.nodeid: t for t in run.tests}
    results = []
    for key in sorted(a_groups.keys() | b_groups.keys()):
        case = ",".join(f"{k}={v}" for k, v in key) or "(no other tags)"
        result = compare_records(a_groups.get(key, {}), b_groups.get(key, {}), case=case, refresh_rel=refresh_rel)
        if key not in b_groups and (why := _unsupported_reason(tests, a_sources[key], a, b)):
            _mark_unsupported(result, Verdict.MISSING_METRIC, f"B ({selector_text(b)})", why)
        elif key not in a_groups and (why := _unsupported_reason(tests, b_sources[key], b, a)):
            _mark_unsupported(result, Verdict.NEW_METRIC, f"A ({selector_text(a)})", why)
        elif key in a_groups and key in b_groups:
            _mark_not_returned(result, Verdict.MISSING_METRIC, f"B ({selector_text(b)})", tests, b_sources[key])
            _mark_not_returned(result, Verdict.NEW_METRIC, f"A ({selector_text(a)})", tests, a_sources[key])
        results.append(result)
    return results


def unsupported_lines(results: Sequence[GateResult]) -> list[str]:
    """One line per side whose backend does not support some metrics: how many, in how many
    groups, and its reasons with counts (the table leaves these metrics out)."""
    by_side: dict[str, tuple[Counter[str], set[str], list[int]]] = {}
    for r in results:
        seen: set[str] = set()
        for c in r.with_verdict(Verdict.UNSUPPORTED):
            side, _, reason = c.detail.partition(": ")
            reasons, cases, metrics = by_side.setdefault(side, (Counter(), set(), [0]))
            if (side, reason) not in seen:
                reasons[reason] += 1
                seen.add((side, reason))
            cases.add(r.case)
            metrics[0] += 1
    lines = []
    for side, (reasons, cases, metrics) in sorted(by_side.items()):
        lines.append(f"unsupported by {side}: {metrics[0]} metric{'s' if metrics[0] != 1 else ''} of "
                     f"{len(cases)} group{'s' if len(cases) != 1 else ''} (not a failure); why, by groups:")
        lines += [f"  {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda item: (-item[1], item[0]))]
    return lines
