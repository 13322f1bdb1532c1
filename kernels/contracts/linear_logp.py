"""The ``linear_logp`` op's contract: selected log-prob of ``hidden @ weight.T (+ bias)``."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kernels import device_errors
from kernels.contracts.call import tensor_case, tp_world
from kernels.contracts.checks import (
    check_ids_values,
    check_target_ids,
    check_temperature,
    check_tensor,
)

HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(slots=True, eq=False)
class LinearLogpCall:
    """``logp_t = z[t, id_t] - logsumexp_v z[t, v]``, ``z = (hidden @ weight.T + bias) / temperature``,
    with the logits accumulated in fp32 and never materialized by the kernels.

    hidden        [T, H] float32 | bfloat16 | float16.
    weight        [V_local, H], hidden's dtype and device: the LM head, or this rank's vocab shard.
    target_ids    [T] int64 | int32 *global* ids in ``[0, global_vocab)``; ``-100`` rows give log-prob
                  0 and gradient 0.
    bias          [V_local], hidden's dtype and device, or None.
    temperature   a finite float > 0.
    tp_group      with it, this rank holds global ids ``[vocab_start, vocab_start + V_local)`` of
                  ``global_vocab`` (required); the hidden states are replicated over the group.
    workspace_bytes
                  a positive int or None: the most memory (bytes) an implementation that chunks over the
                  vocab may hold beyond the inputs, the output and the returned gradients, from the
                  forward through the backward (the Triton op: the more, the more logits the forward
                  keeps for the backward; None: ``RLK_LINEAR_LOGP_WORKSPACE_BYTES``, else 256 MB).
                  It never changes the result; implementations that hold the logits ignore it.
    returns       fp32 [T], autograd to hidden, weight and bias (gradients in their own dtypes).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    target_ids: torch.Tensor
    bias: torch.Tensor | None = None
    temperature: float = 1.0
    _: KW_ONLY
    tp_group: dist.ProcessGroup | None = None
    vocab_start: int = 0
    global_vocab: int | None = None  # resolved to an int by the checks
    workspace_bytes: int | None = None
    tp_world: int = field(init=False, repr=False)
    deferred: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        global_vocab, deferred = check_linear_logp_inputs(
            self.hidden, self.weight, self.target_ids, self.bias, self.temperature, self.tp_group, self.vocab_start,
            self.global_vocab)
        if self.workspace_bytes is not None:
            check_workspace_bytes(self.workspace_bytes)
        self.temperature = float(self.temperature)
        self.global_vocab = global_vocab
        self.tp_world = tp_world(self.tp_group)
        self.deferred = device_errors.begin_call("linear_logp", self.hidden.shape[0], global_vocab) if deferred else 0

    def check_values(self) -> None:
        """The ids' range on the host (checks.check_call_values)."""
        check_ids_values(self.target_ids, self.global_vocab)

    def case(self) -> dict[str, Any]:
        return {**tensor_case(self.hidden), "temperature": self.temperature, "tp_world": self.tp_world}


def check_linear_logp_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    tp_group: object | None,
    vocab_start: int,
    global_vocab: int | None,
) -> tuple[int, bool]:
    """Checks every input (errors name it); returns the global vocab size and whether the ids'
    range is left to the device (checks.check_target_ids)."""
    check_tensor(hidden, "hidden")
    check_tensor(weight, "weight")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V_local, H], got shape {tuple(weight.shape)}")
    if hidden.dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden dtype must be one of float32/bfloat16/float16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    if hidden.shape[0] == 0 or hidden.shape[1] == 0:
        raise ValueError(f"hidden is empty: shape {tuple(hidden.shape)} (T and H must be > 0)")
    if weight.shape[0] == 0:
        raise ValueError(f"weight is empty: shape {tuple(weight.shape)} (V_local must be > 0)")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V_local, H={hidden.shape[1]}], got shape {tuple(weight.shape)}")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    if bias is not None:
        check_tensor(bias, "bias")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}] (V_local), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"bias must be {hidden.dtype} on {hidden.device}, got {bias.dtype} on {bias.device}")
    check_temperature(temperature)
    v_local = weight.shape[0]
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start must be an int >= 0, got {vocab_start!r}")
    if global_vocab is None:
        if tp_group is not None:
            raise ValueError("global_vocab is required with tp_group (the full vocab size over all shards)")
        global_vocab = vocab_start + v_local
    if isinstance(global_vocab, bool) or not isinstance(global_vocab, int) or global_vocab < vocab_start + v_local:
        raise ValueError(
            f"global_vocab must be an int >= vocab_start + V_local = {vocab_start + v_local}, got {global_vocab!r}"
        )
    if tp_group is None and (vocab_start != 0 or global_vocab != v_local):
        raise ValueError(
            f"without tp_group the weight must hold the whole vocab: vocab_start must be 0 and global_vocab "
            f"{v_local}, got vocab_start={vocab_start}, global_vocab={global_vocab}"
        )
    deferred = check_target_ids(target_ids, hidden.shape[0], global_vocab, hidden.device)
    return global_vocab, deferred


def check_workspace_bytes(workspace_bytes: object) -> int:
    """A workspace budget: a positive int (bytes)."""
    if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, int) or workspace_bytes <= 0:
        raise ValueError(f"workspace_bytes must be a positive int (bytes), got {workspace_bytes!r}")
    return workspace_bytes


__all__ = ["HIDDEN_DTYPES", "LinearLogpCall", "check_linear_logp_inputs", "check_workspace_bytes"]
