"""The precision matrix: rollout log-probs in bf16 or fp16 against training log-probs in bf16,
fp16 or fp32, every mismatch metric per cell (pytest_rlk/mismatch).

The FP16 paper (arXiv 2510.26788) names the bf16 rollout itself as the main source of train/rollout
mismatch. Each cell scores the SAME tokens on both sides: the engine's samples of that rollout dtype,
its log-probs, and the training forward of the same checkpoint with its weights and logits in the
cell's training dtype (the ladder's reference arithmetic, one micro-batch). Rollout and training
must mean the same thing by their log-probs (the semantics rung): at temperature 1 without top-k /
top-p, vLLM's raw and processed log-probs coincide, otherwise a rollout whose semantics differ from
the training's is refused with the setting named.

``python -m pytest_rlk.drift.precision MODEL --rollout bf16=ROLLOUT.json --rollout fp16=ROLLOUT.json
[--device cuda] [--out DIR]`` runs the training side on recorded rollouts (pytest_rlk.drift.rollout's
output files): on a GPU image without vLLM, the rollouts come from a host that has it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pytest_rlk.drift import semantics
from pytest_rlk.drift.batch import Sampling, TokenBatch, batch_from_rollout
from pytest_rlk.drift.preconditions import PreconditionError, check_comparable, checkpoint_fingerprint
from pytest_rlk.drift.rungs import SideConfig
from pytest_rlk.drift.sides import TrainingSides
from pytest_rlk.mismatch.metrics import METRIC_NAMES, MismatchMetrics, mismatch_metrics

ROLLOUT_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}
TRAIN_DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class PrecisionCell:
    rollout_dtype: str
    train_dtype: str
    metrics: MismatchMetrics
    seconds: float  # the training side's

    def to_dict(self) -> dict[str, object]:
        return {"rollout_dtype": self.rollout_dtype, "train_dtype": self.train_dtype,
                "metrics": self.metrics.to_dict(), "seconds": self.seconds}


def rollout_batch(rollout: dict) -> TokenBatch:
    """A recorded rollout as a token batch, with its request's sampling."""
    req = rollout["request"]
    sampling = Sampling(temperature=float(req["temperature"]), top_p=float(req.get("top_p", 1.0)),
                        top_k=int(req.get("top_k", -1)), n=int(req["n"]), max_tokens=int(req["max_tokens"]),
                        seed=int(req["seed"]))
    return batch_from_rollout(rollout, sampling)


def check_semantics(batch: TokenBatch, vocab_size: int) -> None:
    """Refuse a rollout whose log-probs mean something else than the training's (naming the setting)."""
    record = batch.rollout
    mode = {"raw": semantics.RAW, "processed": semantics.PROCESSED}.get(record.logprob_space, record.logprob_space)
    rollout = semantics.rollout_semantics(mode, temperature=record.temperature, top_p=record.top_p,
                                          top_k=record.top_k).normalized(vocab_size)
    training = semantics.vime_training_semantics(batch.sampling.temperature).normalized(vocab_size)
    found = semantics.findings(rollout, training, logprobs_mode=mode, sampling=dataclasses.asdict(batch.sampling))
    if found:
        raise PreconditionError(f"precision matrix, {record.dtype} rollout: refused, the sides' log-probs mean "
                                "different things (rung S): " + "; ".join(found))


def precision_matrix(model_dir: str | Path, rollouts: dict[str, dict], *, device: torch.device,
                     train_dtypes: tuple[str, ...] = TRAIN_DTYPES,
                     progress: Callable[[str], None] | None = None) -> list[PrecisionCell]:
    """Every (rollout dtype, training dtype) cell; ``rollouts`` maps a rollout dtype (bf16, fp16) to
    the engine's recorded rollout in that dtype."""
    say = progress or (lambda line: None)
    checkpoint = checkpoint_fingerprint(model_dir)
    cells = []
    for rdtype, rollout in rollouts.items():
        engine_dtype = str(rollout["request"].get("dtype", "bfloat16"))
        if ROLLOUT_DTYPES.get(engine_dtype) != rdtype:
            raise PreconditionError(f"precision matrix: the {rdtype} rollout was generated in {engine_dtype}")
        batch = rollout_batch(rollout)
        sides = TrainingSides(model_dir, batch, checkpoint=checkpoint, device=device)
        vocab = sides.model(torch.float32).get_output_embeddings().weight.shape[0]
        check_semantics(batch, vocab)
        train_pre = sides.preconditions()
        # the fingerprint the engine recorded of what it loaded (the model dir may have moved since)
        roll_pre = batch.rollout.preconditions(rollout.get("checkpoint") or checkpoint_fingerprint(batch.rollout.model))
        # the semantics check above covers what the log-prob space means
        check_comparable(dataclasses.replace(roll_pre, logprob_space=train_pre.logprob_space), train_pre,
                         what=f"precision matrix, {rdtype} rollout")
        rollout_lp = torch.tensor([v for r in batch.rollout_logprobs for v in r], dtype=torch.float64)
        for tdtype in train_dtypes:
            side = sides.side(SideConfig(dtype=tdtype))
            m = mismatch_metrics(side.logp.double(), rollout_lp, batch.flat_mask(), lengths=batch.lengths)
            cells.append(PrecisionCell(rdtype, tdtype, m, side.seconds))
            say(f"precision {rdtype} rollout x {tdtype} training: mean |dlogp| {m.logp_abs_mean:.3g}, "
                f"abs_diff {m.train_rollout_logprob_abs_diff:.3g} ({side.seconds:.2f}s)")
    return cells


def render(cells: list[PrecisionCell], *, where: str = "") -> str:
    head = ["rollout", "training"] + list(METRIC_NAMES)
    lines = [f"## Precision matrix{f' ({where})' if where else ''}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        values = [f"{v:.4g}" for v in c.metrics.values().values()]
        lines.append("| " + " | ".join([c.rollout_dtype, c.train_dtype, *values]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_rlk.drift.precision", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rollout", action="append", required=True, metavar="DTYPE=FILE",
                        help="a recorded rollout (pytest_rlk.drift.rollout's output) in bf16 or fp16")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rollouts = {}
    for item in args.rollout:
        dtype, sep, path = item.partition("=")
        if not sep or dtype not in ROLLOUT_DTYPES.values():
            parser.error(f"--rollout {item!r}: expected bf16=FILE or fp16=FILE")
        try:
            rollouts[dtype] = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            parser.error(f"--rollout {item!r}: not a readable rollout file ({exc})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.device == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device(args.device)
    t0 = time.perf_counter()
    try:
        cells = precision_matrix(args.model, rollouts, device=device, progress=lambda line: print(line, flush=True))
    except PreconditionError as exc:
        print(f"precision matrix: error: {exc}", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    text = render(cells, where=f"training on {where}, {time.perf_counter() - t0:.1f}s")
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "precision.json").write_text(json.dumps([c.to_dict() for c in cells], indent=1))
        (args.out / "precision.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
