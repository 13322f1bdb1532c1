"""``rlk diff RUN --a-tag K=V --b-tag K=V``: two tag selections of ONE run, e.g. two backends.

Every metric of the run (gated or not) whose tags match a side's selectors belongs to that side.
Metrics pair by name plus all their tags except the selecting keys and ``backend_version``; the
pairs go through the same engine as every diff (:func:`pytest_rlk.compare.compare_records`, A is
the reference; the band is the metric's own, else the default of ``pytest_rlk.bands``). A pair
present on one side only is ``new_metric`` (only in B) or ``missing_metric`` (only in A).
"""
from __future__ import annotations

from collections.abc import Sequence

from pytest_rlk.compare import compare_records
from pytest_rlk.options import OptionError
from pytest_rlk.schema import GateResult, MetricRecord, RunRecord

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


def _side(run: RunRecord, selector: Selector, drop: set[str], label: str) -> dict[PairKey, dict[str, MetricRecord]]:
    groups: dict[PairKey, dict[str, MetricRecord]] = {}
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
    return groups


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
    a_groups = _side(run, a, drop, "A")
    b_groups = _side(run, b, drop, "B")
    results = []
    for key in sorted(a_groups.keys() | b_groups.keys()):
        case = ",".join(f"{k}={v}" for k, v in key) or "(no other tags)"
        results.append(compare_records(a_groups.get(key, {}), b_groups.get(key, {}), case=case,
                                       refresh_rel=refresh_rel))
    return results
