"""Do two runs of the same tests give the same per-test results? (``rlk same RUN_A RUN_B``)

Made for a sharded run against a serial one (``--rlk-shard-gpus``), or any two runs that must not
differ: the same test ids, the same outcome per test, and the same metric values (exactly, or
within ``rel_tol``). Values of the measured spaces (time, throughput, memory) differ between any
two runs of the same code; they are compared only when asked (``measured=True``, with a tolerance).
Every other value (errors, log-probs, losses, counts...) is computed, so the same code on the same
inputs must give it again, gated or not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pytest_rlk.compare import scalar_value
from pytest_rlk.schema import RunRecord, TestRecord


@dataclass(frozen=True)
class Difference:
    nodeid: str
    what: str

    def line(self) -> str:
        return f"{self.nodeid}: {self.what}"


MEASURED_SPACES = ("time", "throughput", "memory")


def _values(test: TestRecord, measured: bool) -> dict[str, float]:
    values = {}
    for m in test.metrics:
        if measured or m.space not in MEASURED_SPACES:
            try:
                values[m.name] = scalar_value(m)
            except ValueError:
                values[m.name] = math.nan
    return values


def _same(a: float, b: float, rel_tol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= rel_tol * max(abs(a), abs(b))


def compare_runs(a: RunRecord, b: RunRecord, *, rel_tol: float = 0.0, measured: bool = False) -> list[Difference]:
    """Every difference between A and B, test by test (sorted by test id)."""
    tests_a = {t.nodeid: t for t in a.tests}
    tests_b = {t.nodeid: t for t in b.tests}
    diffs = []
    for nodeid in sorted(tests_a.keys() | tests_b.keys()):
        ta, tb = tests_a.get(nodeid), tests_b.get(nodeid)
        if ta is None or tb is None:
            diffs.append(Difference(nodeid, "only in A" if tb is None else "only in B"))
            continue
        if ta.outcome != tb.outcome:
            diffs.append(Difference(nodeid, f"outcome: A {ta.outcome}, B {tb.outcome}"))
        va, vb = _values(ta, measured), _values(tb, measured)
        for name in sorted(va.keys() | vb.keys()):
            if name not in va or name not in vb:
                diffs.append(Difference(nodeid, f"{name}: only in {'B' if name not in va else 'A'}"))
            elif not _same(va[name], vb[name], rel_tol):
                diffs.append(Difference(nodeid, f"{name}: A {va[name]!r}, B {vb[name]!r}"))
    return diffs


def compared_value_count(run: RunRecord, measured: bool = False) -> int:
    return sum(len(_values(t, measured)) for t in run.tests)
