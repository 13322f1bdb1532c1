"""The drift table of a run (rung x source: the diagnostics) and the attribution of A5's drift."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pytest_rlk.drift.mismatch_table import mismatch_lines
from pytest_rlk.drift.rungs import RUNGS
from pytest_rlk.drift.result import Comparison, LadderResult

PRODUCTION = "A5/vllm-vs-kernels"  # the production comparison: the rollout against training with the kernels
MATCHED_DTYPE = "A5/vllm-vs-bf16"  # the rollout against training in the rollout's dtype: the engine's own part
SPACE_NOTE = (
    "All |dlogp| columns are in log-prob space (natural log of the sampled token's probability after "
    "temperature); dlogp = logp_B - logp_A over the active response tokens (A5: A = the rollout engine, "
    "B = training). ratio0 = exp(dlogp) is a probability ratio (the PPO ratio of the first step under "
    "--use-rollout-logprobs); clipfrac0 = share of tokens with ratio0 outside [1 - eps_clip, 1 + eps_clip_high]; "
    "approx_kl0 = mean(exp(dlogp) - 1 - dlogp); abs_diff = vime's train_rollout_logprob_abs_diff (mean over "
    "samples of each sample's token mean |dlogp|).")
NONLINEAR_NOTE = (
    "Shares do not add up to 100%: sources interact (their token-level errors partly cancel or compound), "
    "independent errors add roughly in quadrature rather than linearly, and A5 also contains what no "
    "training-side rung reproduces (the engine's own kernels, KV cache and batching). A share says how "
    "much drift one source alone produces, next to the production drift; the A4 rows show how pairs combine.")


@dataclass(frozen=True)
class Share:
    key: str
    mean: float
    share: float  # of the production comparison's mean |dlogp|


def attribution(result: LadderResult) -> tuple[Comparison | None, list[Share]]:
    """(the production comparison or None, each ran training-side comparison's share of its mean |dlogp|)."""
    try:
        prod = result.get(PRODUCTION)
    except KeyError:
        return None, []
    if prod.diagnostics is None or prod.diagnostics.abs_mean == 0:
        return prod, []
    base = prod.diagnostics.abs_mean
    shares = [Share(c.spec.key, c.diagnostics.abs_mean, c.diagnostics.abs_mean / base)
              for c in result.comparisons if c.diagnostics is not None and c.spec.rung in ("A0", "A1", "A2", "A3", "A4")]
    return prod, shares


def _g(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def _changed(c: Comparison) -> str:
    if c.spec.rung == "A5":
        return f"{c.spec.a.label} -> training {c.spec.b.label}"
    diff = sorted(c.spec.a.differing(c.spec.b))
    if not diff:
        return "nothing (recomputed)"
    return ", ".join(f"{f}: {getattr(c.spec.a, f)} -> {getattr(c.spec.b, f)}" for f in diff)


def _row(c: Comparison) -> list[str]:
    head = [c.spec.rung, c.spec.source, _changed(c)]
    if c.diagnostics is None:
        return head + ["skipped: " + (c.skipped or "?")] + [""] * 11
    d = c.diagnostics
    w = d.worst
    verdict = f"**FAIL**: {c.violation}" if c.violation else "ok"
    return head + [
        str(d.active_tokens), _g(d.abs_mean), _g(d.abs_p50), _g(d.abs_p90), _g(d.abs_p99), _g(d.abs_max), _g(d.abs_diff),
        f"{d.ratio0_mean:.6f} [{d.ratio0_min:.4f}, {d.ratio0_max:.4f}]", _g(d.clipfrac0), _g(d.approx_kl0),
        f"s{w.sample} p{w.position} id{w.token_id}: {w.logp_a:.5f} -> {w.logp_b:.5f}", f"{d.layout_a}/{d.layout_b}",
        f"{c.contract.describe()}: {verdict}",
    ]


HEADERS = ["rung", "source", "what B changes", "tokens", "mean", "p50", "p90", "p99", "max", "abs_diff",
           "ratio0 mean [min, max]", "clipfrac0", "approx_kl0", "worst token (sample, pos, id: A -> B)",
           "layout A/B", "contract: verdict"]


def _md(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return out + ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]


def attribution_lines(result: LadderResult) -> list[str]:
    prod, shares = attribution(result)
    if prod is None:
        return ["No A5 comparison in this ladder: nothing to attribute."]
    if prod.diagnostics is None:
        return [f"A5 did not run here ({prod.skipped}): the rungs' drift is shown without attribution."]
    d = prod.diagnostics
    lines = [f"Production drift ({PRODUCTION}): mean |dlogp| {_g(d.abs_mean)}, max {_g(d.abs_max)}, "
             f"vime abs_diff {_g(d.abs_diff)}. Each training-side source alone, as a share of that mean:", ""]
    rows = [[s.key, _g(s.mean), f"{100 * s.share:.3g}%"] for s in sorted(shares, key=lambda s: -s.share)]
    lines += _md(["source", "mean |dlogp|", "share of A5"], rows) + [""]
    single = [s for s in shares if s.key.split("/")[0] in ("A1", "A2", "A3")]
    if single:
        top = max(single, key=lambda s: s.share)
        lines.append(f"Largest single source: {top.key} ({RUNGS[top.key.split('/')[0]].title}), "
                     f"{100 * top.share:.3g}% of A5's mean |dlogp|.")
    try:
        matched = result.get(MATCHED_DTYPE).diagnostics
    except KeyError:
        matched = None
    if matched is not None:
        lines.append(f"With training in the rollout's dtype ({MATCHED_DTYPE}) the engine still differs by "
                     f"{_g(matched.abs_mean)} ({100 * matched.abs_mean / d.abs_mean:.3g}% of A5's mean |dlogp|): "
                     "its own kernels, KV cache and batching, which no training-side rung reproduces.")
    by_key = {s.key: s for s in shares}
    for c in result.rung("A4"):
        if c.diagnostics is None:
            continue
        parts = [_part_key(result, c, f) for f in sorted(c.spec.a.differing(c.spec.b))]
        if all(p in by_key for p in parts):
            total = sum(by_key[p].mean for p in parts)
            lines.append(f"Pair {c.spec.key}: {_g(c.diagnostics.abs_mean)} vs its parts' sum {_g(total)} "
                         f"({' + '.join(parts)}).")
    return lines + ["", NONLINEAR_NOTE]


def _part_key(result: LadderResult, pair: Comparison, factor: str) -> str:
    """The single-factor comparison that changes only ``factor`` the way ``pair`` does."""
    for c in result.comparisons:
        if c.spec.rung in ("A1", "A2", "A3") and c.spec.a == pair.spec.a and c.spec.a.differing(c.spec.b) == {factor} \
                and getattr(c.spec.b, factor) == getattr(pair.spec.b, factor):
            return c.spec.key
    return f"?{factor}"


def render(results: list[LadderResult], *, plot: Path | None = None, plot_note: str | None = None) -> str:
    lines = ["# Train/rollout drift ladder", "", SPACE_NOTE, ""]
    for r in results:
        p = r.preconditions
        lines += [f"## {r.model}", "",
                  f"- model dir: `{r.model_dir}` (checkpoint {r.checkpoint}); device {r.device} ({r.hardware}); "
                  f"ladder time {r.seconds:.1f}s; deterministic algorithms {'on' if r.deterministic else 'off'}",
                  f"- tokens: {r.active_tokens} active response tokens sampled by {r.token_source}; sampling "
                  + ", ".join(f"{k} {v}" for k, v in r.sampling.items()),
                  f"- preconditions every comparison shares: token ids {p['token_ids']}, masks {p['masks']}, "
                  f"temperature {p['temperature']}, top_p {p['top_p']}, top_k {p['top_k']}, "
                  f"log-prob space {p['logprob_space']}",
                  "- software: " + ", ".join(f"{k} {v}" for k, v in r.software.items() if v), ""]
        lines += _md(HEADERS, [_row(c) for c in r.comparisons]) + [""]
        lines += mismatch_lines(r.comparisons)
        lines += ["### Attribution", ""] + attribution_lines(r) + [""]
    if plot is not None:
        lines += [f"![|dlogp| quantiles per rung]({plot.name})", ""]
    elif plot_note:
        lines += [plot_note, ""]
    return "\n".join(lines)
