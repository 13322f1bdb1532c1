"""The drift table's mismatch section: every comparison's metrics of the mismatch table
(pytest_rlk/mismatch/metrics.py), one column per metric, side A in the place of the rollout."""

from __future__ import annotations

from collections.abc import Iterable

from pytest_rlk.mismatch.metrics import METRIC_NAMES

NOTE = ("Every metric of the mismatch table (docs/drift.md, pytest_rlk/mismatch/metrics.py) with d = logp_B - logp_A "
        "and w = exp(d): B in the place of training, A of the rollout.")


def mismatch_lines(comparisons: Iterable) -> list[str]:
    """Markdown lines: a row per comparison that ran (``c.spec.rung``, ``c.spec.source``,
    ``c.diagnostics.mismatch``)."""
    head = ["rung", "source"] + list(METRIC_NAMES)
    lines = ["### Mismatch metrics", "", NOTE, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comparisons:
        if c.diagnostics is None:
            continue
        m = c.diagnostics.mismatch
        cells = [("0" if m[n] == 0 else f"{m[n]:.4g}") if n in m else "-" for n in METRIC_NAMES]
        lines.append("| " + " | ".join([c.spec.rung, c.spec.source] + cells) + " |")
    return lines + [""]
