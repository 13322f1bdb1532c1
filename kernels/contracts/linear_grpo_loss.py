"""The ``linear_grpo_loss`` contract: vime's GRPO loss of ``hidden @ weight.T (+ bias)``.

No public entry point serves it yet; backends that fuse the LM head into the loss (``liger``)
serve it under this name, and the op tier checks them against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.contracts.call import tensor_case
from kernels.contracts.checks import check_ids_values
from kernels.contracts.grpo_loss import LossInputs
from kernels.contracts.linear_logp import check_linear_logp_inputs


@dataclass(slots=True, eq=False)
class LinearGrpoLossCall(LossInputs):
    """vime's GRPO loss (GrpoLossCall) with the logits ``hidden @ weight.T (+ bias)`` never materialized.

    hidden, weight, target_ids, bias, temperature: as in LinearLogpCall, single device (no TP).
    (old_logp ... rollout_logp: LossInputs, keyword-only.)
    returns    (loss 0-dim fp32, autograd to hidden, weight and bias; {metric: detached 0-dim fp32}).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    target_ids: torch.Tensor
    bias: torch.Tensor | None = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        # no kernel of ours serves this op: values left to the device are checked here, on the host
        vocab, ids_deferred = check_linear_logp_inputs(self.hidden, self.weight, self.target_ids, self.bias,
                                                       self.temperature, None, 0, None)
        if ids_deferred:
            check_ids_values(self.target_ids, vocab)
        if self.check(self.hidden.shape[0], self.hidden.device):
            self.check_lengths_values(self.hidden.shape[0])
        self.temperature = float(self.temperature)

    def case(self) -> dict[str, Any]:
        return {**tensor_case(self.hidden), "temperature": self.temperature, "tp_world": 1,
                "config": self.config, "num_samples": self.num_samples()}


__all__ = ["LinearGrpoLossCall"]
