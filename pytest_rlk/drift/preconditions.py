"""What two sides of a comparison must share, and the check that refuses a comparison otherwise.

A drift number means something only when both sides scored the same thing: the same checkpoint,
the same token ids, the same masks, under the same sampling parameters and temperature, in the same
log-prob space (vLLM's ``processed_logprobs``: after temperature). Each side reports the
preconditions of what it actually used (the training side hashes the ids it forwarded, the rollout
side reports what the engine returned); :func:`check_comparable` raises
:class:`PreconditionError` naming every field that differs. What a rung deliberately changes
(arithmetic, layout, dtype, engine) is not a precondition: see rungs.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Checkpoints up to this size are hashed whole; larger ones by size and their first and last MiB
# per file (reading 60 GB to compare two sides of one run would dominate the ladder's time).
FULL_HASH_MAX_BYTES = 2 << 30
SAMPLE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
CONFIG_FILES = ("config.json",)


class PreconditionError(ValueError):
    """Two sides of a comparison did not score the same thing."""


@dataclass(frozen=True)
class Preconditions:
    checkpoint: str  # fingerprint of the model directory's weights and config
    token_ids: str  # fingerprint of every (prompt ids, response ids) pair, in order
    masks: str  # fingerprint of the response lengths and the loss mask
    temperature: float
    top_p: float
    top_k: int  # -1: off
    logprob_space: str  # "processed" (after temperature), the space vime's rollout_log_probs are in

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @property
    def fingerprint(self) -> str:
        return digest(json.dumps(self.to_dict(), sort_keys=True))[:12]


def digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()


def sequences_fingerprint(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> str:
    return digest(json.dumps([[list(map(int, p)), list(map(int, r))] for p, r in zip(prompts, responses, strict=True)]))[:16]


def masks_fingerprint(lengths: Iterable[int], mask: Iterable[float]) -> str:
    return digest(json.dumps([list(map(int, lengths)), [float(m) for m in mask]]))[:16]


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """Fingerprint of a model directory: its config and weight files (content-hashed up to
    :data:`FULL_HASH_MAX_BYTES` in total, else size + first/last MiB per file; the method is part of
    the string, so two methods never compare equal)."""
    root = Path(model_dir)
    files = sorted(p for p in root.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in CONFIG_FILES))
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise PreconditionError(f"{root}: no weight files ({', '.join(WEIGHT_SUFFIXES)}) to fingerprint")
    total = sum(p.stat().st_size for p in files)
    full = total <= FULL_HASH_MAX_BYTES
    h = hashlib.sha256()
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}\0".encode())
        with p.open("rb") as f:
            if full:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            else:
                h.update(f.read(SAMPLE_BYTES))
                f.seek(max(0, size - SAMPLE_BYTES))
                h.update(f.read(SAMPLE_BYTES))
    return f"{'sha256' if full else 'sampled'}:{h.hexdigest()[:16]}"


def differences(a: Preconditions, b: Preconditions) -> list[str]:
    """``field: a != b`` for each field that differs."""
    return [f"{f.name}: {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
            for f in dataclasses.fields(Preconditions) if getattr(a, f.name) != getattr(b, f.name)]


def check_comparable(a: Preconditions, b: Preconditions, *, what: str) -> None:
    """Raise :class:`PreconditionError` naming ``what`` and each differing field."""
    diff = differences(a, b)
    if diff:
        raise PreconditionError(f"{what}: refused, the sides did not score the same thing: " + "; ".join(diff))
