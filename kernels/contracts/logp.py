"""The ``logp`` op's contract: selected log-prob from logits (single device or vocab-parallel)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kernels.contracts.call import tensor_case, tp_world
from kernels import device_errors
from kernels.contracts.checks import IGNORE_INDEX, check_ids_values, check_logits, check_target_ids, check_temperature


@dataclass(slots=True, eq=False)
class LogpCall:
    """``logp_t = z[t, id_t] - logsumexp_v z[t, v]``, ``z = logits / temperature`` (vime's selected log-prob).

    logits        [T, V] float32 | bfloat16 | float16, contiguous along V. With ``tp_group``:
                  [T, V_local], this rank holding global ids ``[rank * V_local, (rank + 1) * V_local)``.
    target_ids    [T] int64 | int32 global ids in ``[0, V * world)``, or ``ignore_index`` (that row
                  gives log-prob 0 and gradient 0).
    temperature   a finite float > 0.
    tp_group      the process group the vocab is split over, or None.
    returns       fp32 [T], autograd to ``logits`` (identical on every rank of ``tp_group``).

    Every input is checked when the call is built (kernels/contracts/checks.py); the ids' range there
    for CPU tensors, else by the kernels (``deferred``: the call id they report under, 0 if checked).
    """

    logits: torch.Tensor
    target_ids: torch.Tensor
    temperature: float = 1.0
    _: KW_ONLY
    tp_group: dist.ProcessGroup | None = None
    ignore_index: int = IGNORE_INDEX
    num_tokens: int = field(init=False, repr=False)
    vocab: int = field(init=False, repr=False)  # this rank's columns
    tp_world: int = field(init=False, repr=False)
    deferred: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        num_tokens, vocab = check_logits(self.logits)
        temperature = check_temperature(self.temperature)
        world = tp_world(self.tp_group)
        deferred = check_target_ids(self.target_ids, num_tokens, vocab * world, self.logits.device, self.ignore_index)
        self.deferred = device_errors.begin_call("logp", num_tokens, vocab) if deferred else 0
        self.temperature = temperature
        self.ignore_index = int(self.ignore_index)
        self.num_tokens = num_tokens
        self.vocab = vocab
        self.tp_world = world

    def check_values(self) -> None:
        """The ids' range on the host (checks.check_call_values)."""
        check_ids_values(self.target_ids, self.vocab * self.tp_world, self.ignore_index)

    def case(self) -> dict[str, Any]:
        return {**tensor_case(self.logits), "temperature": self.temperature, "tp_world": self.tp_world}


__all__ = ["LogpCall"]
