"""Window aggregation of per-step series: skip warmup steps, then one statistic."""
from __future__ import annotations

import math
from collections.abc import Sequence

from pytest_rlk.schema import Window


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), ``q`` in [0, 100]."""
    if not values:
        raise ValueError("percentile of an empty series")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def aggregate(values: Sequence[float], window: Window, *, name: str = "series") -> float:
    """One number from a series; an empty window is an error naming the metric."""
    kept = list(values)[window.skip:]
    if not kept:
        raise ValueError(
            f"metric {name!r}: window skips {window.skip} warmup steps but the series has "
            f"only {len(values)}"
        )
    match window.agg:
        case "mean":
            return math.fsum(kept) / len(kept)
        case "median":
            return percentile(kept, 50)
        case "p90":
            return percentile(kept, 90)
        case "p99":
            return percentile(kept, 99)
        case "last":
            return kept[-1]
        case "min":
            return min(kept)
        case "max":
            return max(kept)
    raise ValueError(f"metric {name!r}: unknown aggregation {window.agg!r}")
