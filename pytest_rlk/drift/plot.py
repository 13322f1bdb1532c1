"""The ladder plot: one column per comparison (grouped by rung), its |dlogp| quantiles on a log
axis, one panel per model. A bitwise-equal comparison (0) is drawn on the axis floor and labelled."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pytest_rlk.drift.result import LadderResult

QUANTILES = (("abs_p50", "p50", "o"), ("abs_p90", "p90", "s"), ("abs_p99", "p99", "^"), ("abs_max", "max", "v"),
             ("abs_mean", "mean", "x"))
FLOOR = 1e-10  # where 0 is drawn on the log axis


def plot_ladder(results: list[LadderResult], path: Path) -> Path:
    fig = Figure(figsize=(max(8.0, 0.5 * max(len(r.comparisons) for r in results) + 3), 4.2 * len(results)))
    for i, result in enumerate(results):
        ax = fig.add_subplot(len(results), 1, i + 1)
        ran = [c for c in result.comparisons if c.diagnostics is not None]
        xs = range(len(ran))
        for attr, label, marker in QUANTILES:
            ys = [max(getattr(c.diagnostics, attr), FLOOR) for c in ran]
            ax.scatter(xs, ys, marker=marker, label=label, s=28)
        for x, c in zip(xs, ran):
            if c.diagnostics.abs_max == 0:
                ax.annotate("0 (bitwise)", (x, FLOOR), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize="x-small")
        edges = [k for k in range(1, len(ran)) if ran[k].spec.rung != ran[k - 1].spec.rung]
        for k in edges:
            ax.axvline(k - 0.5, color="0.8", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [f"{c.spec.rung} {c.spec.source}" for c in ran], rotation=40, ha="right",
                      fontsize="small")
        ax.set_ylabel("|dlogp| (log-prob space, log scale)")
        ax.set_title(f"{result.model}: |logp_B - logp_A| per rung ({result.hardware}, {result.active_tokens} tokens)")
        ax.legend(fontsize="x-small", ncol=5, loc="upper left")
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
