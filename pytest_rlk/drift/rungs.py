"""The rungs of the alignment ladder and the comparisons each one runs.

A *side* is one way of computing the response tokens' log-probs, described by a :class:`SideConfig`:
which engine (training or the rollout engine), which arithmetic (the reference, our kernels, a
third-party backend, Megatron's cross-entropy), which batch layout / topology, which
representation (dtype). A *comparison* is two sides; its rung is fixed by the factors in which the
two sides differ:

==== ======================================= ==========================================
rung what differs                            factors
==== ======================================= ==========================================
A0   nothing: the same forward twice         none (must be bitwise equal)
A1   arithmetic only                         ``arith``
A2   reduction / topology only               ``layout``
A3   representation only                     ``dtype``
A4   two of the above                        exactly two of ``arith``, ``layout``, ``dtype``
A5   production: the rollout engine          ``engine`` (and whatever else the engine does)
==== ======================================= ==========================================

:func:`check_rung` refuses a comparison whose sides differ in anything but its rung's factors, so
a comparison labelled A1 can never hide a dtype change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FACTORS = ("arith", "layout", "dtype")  # what the training-side rungs vary, one or two at a time

# arith: how the log-prob is computed from the model's output.
ARITHS = {
    "reference": "fp32 reference (eager PyTorch: log-softmax + gather on the logits)",
    "kernels": "our kernel: kernels.logp on the logits (the configured backend, rlk-triton by default)",
    "kernels-linear": "our fused LM head: kernels.linear_logp on the final hidden states and the LM-head weight",
    "liger": "Liger-Kernel's fused_selective_log_softmax through the backend contract (kernels.logp, backend liger)",
    "megatron": "megatron-core's vocab_parallel_cross_entropy (logp = -CE)",
}
# layout: which samples share a forward, how they are padded or packed, how the vocab is split.
LAYOUTS = {
    "batch": "all samples in one micro-batch, right-padded to the longest",
    "alone": "each sample forwarded alone (no batch companions, no padding)",
    "pad16": "the micro-batch right-padded by 16 extra positions",
    "packed": "all samples packed into one row (position ids restart per sample, no padding)",
    "micro2": "two micro-batches (the samples split in halves, each padded to its own longest)",
    "tp2": "the LM head and the log-softmax vocab-parallel over 2 ranks (TP=2)",
}
# dtype: the representation of the weights and the logits.
DTYPES = {
    "fp32": "fp32 weights, fp32 logits",
    "bf16-logits": "fp32 forward, logits rounded to bf16",
    "bf16": "bf16 weights and activations (the model cast to bf16), bf16 logits",
    "fp16": "fp16 weights and activations, fp16 logits",
}
ENGINES = ("train", "vllm")


class LadderError(ValueError):
    """A comparison whose sides do not differ in exactly its rung's factors (or an unknown name)."""


@dataclass(frozen=True)
class SideConfig:
    """One side of a comparison. The defaults are A0's side: the training forward as vime feeds
    its loss (fp32 logits, one micro-batch, the fp32 reference)."""

    engine: str = "train"
    arith: str = "reference"
    layout: str = "batch"
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise LadderError(f"engine {self.engine!r}: not one of {ENGINES}")
        if self.engine == "train":
            for name, known in (("arith", ARITHS), ("layout", LAYOUTS), ("dtype", DTYPES)):
                value = getattr(self, name)
                if value not in known:
                    raise LadderError(f"{name} {value!r}: not one of {sorted(known)}")

    @property
    def label(self) -> str:
        if self.engine != "train":
            return f"{self.engine} rollout ({self.dtype})"
        return f"{self.arith}/{self.layout}/{self.dtype}"

    def differing(self, other: SideConfig) -> frozenset[str]:
        """The fields (``engine`` and :data:`FACTORS`) in which ``other`` differs from this side."""
        return frozenset(f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name))


A0_SIDE = SideConfig()


@dataclass(frozen=True)
class Rung:
    id: str
    title: str
    description: str


RUNGS: dict[str, Rung] = {r.id: r for r in (
    Rung("A0", "aligned", "the same training forward twice: the harness's own noise floor (bitwise)"),
    Rung("A1", "arithmetic", "one log-prob implementation against the reference, on the same logits / hidden states"),
    Rung("A2", "reduction / topology", "the same math over another batch layout or vocab split (batch invariance, TP)"),
    Rung("A3", "representation", "the same math on weights / logits in another dtype"),
    Rung("A4", "pairs", "two of arithmetic, topology and representation changed together"),
    Rung("A5", "production", "the rollout engine's own log-probs against the training forward"),
)}


@dataclass(frozen=True)
class ComparisonSpec:
    """``b`` measured against ``a`` (dlogp = logp_b - logp_a); ``source`` names what ``b`` changes."""

    rung: str
    source: str
    a: SideConfig
    b: SideConfig

    @property
    def key(self) -> str:
        return f"{self.rung}/{self.source}"


def check_rung(spec: ComparisonSpec) -> None:
    """Raise :class:`LadderError` unless ``spec.b`` differs from ``spec.a`` in exactly the rung's factors."""
    if spec.rung not in RUNGS:
        raise LadderError(f"{spec.key}: unknown rung {spec.rung!r}; rungs: {', '.join(RUNGS)}")
    diff = spec.a.differing(spec.b)
    where = f"{spec.key} ({spec.a.label} vs {spec.b.label})"
    if spec.rung == "A5":
        if "engine" not in diff:
            raise LadderError(f"{where}: A5 compares the rollout engine with training; both sides are {spec.a.engine}")
        return
    if "engine" in diff:
        raise LadderError(f"{where}: the engine differs; that is rung A5, not {spec.rung}")
    expected = {"A0": 0, "A1": 1, "A2": 1, "A3": 1, "A4": 2}[spec.rung]
    allowed = {"A0": set(), "A1": {"arith"}, "A2": {"layout"}, "A3": {"dtype"}, "A4": set(FACTORS)}[spec.rung]
    if len(diff) != expected or not diff <= allowed:
        changed = ", ".join(sorted(diff)) or "nothing"
        raise LadderError(f"{where}: {spec.rung} changes exactly {expected} of {sorted(allowed) or 'none'}, "
                          f"but {changed} differ(s)")


def _pair(a: SideConfig, **changes: str) -> SideConfig:
    return dataclasses.replace(a, **changes)


def default_ladder(*, tp: bool = True, rollout: bool = True) -> list[ComparisonSpec]:
    """The comparisons the ladder runs by default, in rung order (``tp``: the TP=2 sources;
    ``rollout``: the A5 sources against the rollout engine's log-probs)."""
    a0 = A0_SIDE
    one = {
        "A1": [("kernels", {"arith": "kernels"}), ("kernels-linear", {"arith": "kernels-linear"}),
               ("liger", {"arith": "liger"})],
        "A2": [("alone", {"layout": "alone"}), ("pad16", {"layout": "pad16"}), ("packed", {"layout": "packed"}),
               ("micro2", {"layout": "micro2"})] + ([("tp2", {"layout": "tp2"})] if tp else []),
        "A3": [("bf16-logits", {"dtype": "bf16-logits"}), ("bf16", {"dtype": "bf16"}), ("fp16", {"dtype": "fp16"})],
        "A4": [("kernels+bf16", {"arith": "kernels", "dtype": "bf16"}),
               ("kernels+micro2", {"arith": "kernels", "layout": "micro2"}),
               ("alone+bf16", {"layout": "alone", "dtype": "bf16"})]
              + ([("kernels+tp2", {"arith": "kernels", "layout": "tp2"}),
                  ("megatron+tp2", {"arith": "megatron", "layout": "tp2"})] if tp else []),
    }
    specs = [ComparisonSpec("A0", "twice", a0, a0)]
    for rung, sources in one.items():
        specs += [ComparisonSpec(rung, name, a0, _pair(a0, **changes)) for name, changes in sources]
    if rollout:
        vllm = SideConfig(engine="vllm", arith="vllm", layout="vllm", dtype="bf16")
        # production (training with the kernels), the same without them, and training in the
        # rollout's dtype: what is left when the representation matches (the engine's own kernels,
        # KV cache and batching)
        specs += [ComparisonSpec("A5", "vllm-vs-kernels", vllm, _pair(a0, arith="kernels")),
                  ComparisonSpec("A5", "vllm-vs-reference", vllm, a0),
                  ComparisonSpec("A5", "vllm-vs-bf16", vllm, _pair(a0, dtype="bf16"))]
    for spec in specs:
        check_rung(spec)
    return specs


def select(specs: list[ComparisonSpec], rungs: str | None) -> list[ComparisonSpec]:
    """Keep the comparisons of the comma-separated ``rungs`` (``"A0,A1"``); None keeps all."""
    if not rungs:
        return specs
    wanted = [r.strip().upper() for r in rungs.split(",") if r.strip()]
    unknown = [r for r in wanted if r not in RUNGS]
    if unknown:
        raise LadderError(f"unknown rung(s) {unknown}; rungs: {', '.join(RUNGS)}")
    return [s for s in specs if s.rung in wanted]
