"""The ladder's results: one ``Comparison`` per rung pair (its contract, diagnostics, side summaries,
or why it was skipped / how it broke its contract) and a ``LadderResult`` per model, with the
round trip through ``drift.json``. The runner builds them; the table, plot and metrics read them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pytest_rlk.drift.contracts import Contract
from pytest_rlk.drift.diagnostics import SPACE, Diagnostics
from pytest_rlk.drift.rungs import ComparisonSpec, SideConfig


@dataclass
class Comparison:
    spec: ComparisonSpec
    contract: Contract
    diagnostics: Diagnostics | None = None
    a: dict | None = None  # side summaries (config, implementation, layout, preconditions, seconds)
    b: dict | None = None
    skipped: str | None = None  # why it did not run here
    violation: str | None = None  # how it broke its contract

    def to_dict(self) -> dict[str, object]:
        return {"rung": self.spec.rung, "source": self.spec.source,
                "a_config": dataclasses.asdict(self.spec.a), "b_config": dataclasses.asdict(self.spec.b),
                "contract": dataclasses.asdict(self.contract),
                "diagnostics": self.diagnostics.to_dict() if self.diagnostics else None,
                "a": self.a, "b": self.b, "skipped": self.skipped, "violation": self.violation}

    @classmethod
    def from_dict(cls, data: dict) -> Comparison:
        spec = ComparisonSpec(data["rung"], data["source"], SideConfig(**data["a_config"]), SideConfig(**data["b_config"]))
        diag = Diagnostics.from_dict(data["diagnostics"]) if data["diagnostics"] else None
        return cls(spec, Contract(**data["contract"]), diag, data["a"], data["b"], data["skipped"], data["violation"])


@dataclass
class LadderResult:
    model: str  # a label: the model dir's name or what the caller called it
    model_dir: str
    checkpoint: str
    device: str
    hardware: str
    token_source: str
    sampling: dict[str, object]
    active_tokens: int
    preconditions: dict[str, object]
    comparisons: list[Comparison]
    seconds: float
    software: dict[str, str | None] = field(default_factory=dict)
    deterministic: bool = False  # torch.use_deterministic_algorithms was on
    space: str = SPACE

    def rung(self, rung: str) -> list[Comparison]:
        return [c for c in self.comparisons if c.spec.rung == rung]

    def get(self, key: str) -> Comparison:
        for c in self.comparisons:
            if c.spec.key == key:
                return c
        raise KeyError(f"no comparison {key!r} in the ladder of {self.model}; have {[c.spec.key for c in self.comparisons]}")

    @property
    def violations(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.violation]

    def to_dict(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data["comparisons"] = [c.to_dict() for c in self.comparisons]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> LadderResult:
        return cls(**{**data, "comparisons": [Comparison.from_dict(c) for c in data["comparisons"]]})
