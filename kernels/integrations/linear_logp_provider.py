"""linear_logp provider for vime's fork: ``--linear-logp-provider kernels.integrations.linear_logp_provider.provide``.

The fork (``vime/backends/megatron_utils/linear_logp_provider.py``) loads the provider by dotted path
(``pkg.module.callable``) and calls it with one ``LinearLogpRequest`` from its ``compute_linear_logp``;
``provide`` reads that request by attribute (the field names below are the fork's):

* ``logits [T, V_local]``: the LM head's raw output (not divided by the temperature; the fork keeps them
  for its native path, which divides by the temperature itself), ``target_ids [T]``,
  ``tensor_parallel_group``, ``token_layout``, ``with_entropy``, ``with_entropy_grad``, ``chunk_size``,
  ``log_prob_keep_mask [T, V_local] | None``, ``temperature float | Tensor | None``, ``metadata``;
* ``context``: ``hidden [T, H]``, ``projection.weight [V_local, H]`` / ``.bias``, ``vocab_partition``
  ``(local_start, local_size, real_size, padded_size)``.

It returns ``LinearLogpResult(logp [T, 1] fp32, entropy [T] | None, backend_id, contract_id,
provenance)``. A request it cannot serve raises ``LinearLogpProviderUnavailable`` (an exception with
``linear_logp_provider_unavailable = True``, the only "unavailable" signal the fork reads): the fork's
``--linear-logp-provider-mode`` decides what follows (``auto``: a WARNING and vime's native path;
``strict``: ``RuntimeError``). The mode is the fork's business, read from its ``args``; the request
carries none.

Served: the log-prob of every row through the public ``linear_logp`` op (:mod:`kernels.dispatch`:
``VIME_RL_KERNEL``, the backend switch, strict mode and the fallback counters apply; ``backend_id`` names
the backend that computed it). Rows are independent, so every token layout is served. With
``with_entropy`` the entropy comes from the request's logits divided by the temperature (fp32 softmax of
``logits / T``, what vime's native path computes; autograd only with ``with_entropy_grad``), on one
vocab shard only. Declined (unavailable, with the reason): no context; a ``log_prob_keep_mask`` (top-p
replay renormalizes over kept tokens, which the fused kernel does not); a per-row temperature tensor;
entropy over a sharded vocab; target ids at or past ``real_size``; a sharded vocab without a TP group;
any input the op rejects.
``temperature = None`` means no temperature (1.0), as on the fork's native path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import dispatch
from kernels.contracts import LinearLogpCall

# What to pass as --linear-logp-provider: the fork's form is pkg.module.callable (last dot = callable).
DOTTED_PATH = "kernels.integrations.linear_logp_provider.provide"
BACKEND_ID = "rlk-triton/0.1.0"  # the backend this provider serves from when the kernels are on
CONTRACT_ID = "vime.linear_logp.provider/v1"


class LinearLogpProviderUnavailable(RuntimeError):
    """This request is not served here: the fork's auto mode runs its native path, strict mode fails.

    The fork recognises it by the attribute, not by the class (provider packages stay independent)."""

    linear_logp_provider_unavailable = True


@dataclass(frozen=True)
class LinearLogpResult:
    """What the fork's ``_normalize_result`` reads (by attribute)."""

    logp: torch.Tensor  # [T, 1] float32 on the logits' device
    entropy: torch.Tensor | None  # [T] float32 exactly when with_entropy, else None
    backend_id: str
    contract_id: str
    provenance: dict = field(default_factory=dict)


def _unavailable(reason: str) -> LinearLogpProviderUnavailable:
    return LinearLogpProviderUnavailable(f"RL-Kernel linear_logp is unavailable: {reason}")


def _temperature(value: Any, rows: int) -> float:
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise _unavailable(f"per-row temperature (a tensor of {value.numel()} values for {rows} rows)")
        value = value.reshape(()).item()
    value = float(value)
    if not value > 0.0:
        raise _unavailable(f"temperature <= 0 ({value})")
    return value


def _tp_world(group: Any) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def _entropy(logits: torch.Tensor, temperature: float, with_grad: bool) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per row, fp32: ``-sum_v p_v log p_v``.

    The fork's request carries the LM head's raw logits; its native path divides them by the rollout
    temperature (only where it is not 1) before the softmax, and so does this."""
    with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        log_p = torch.log_softmax(z, dim=-1)
        return -(log_p.exp() * log_p).sum(dim=-1)


def _call(request: Any) -> tuple[LinearLogpCall, dict]:
    """The checked ``linear_logp`` call for ``request`` and what provenance reports, or unavailable."""
    context = getattr(request, "context", None)
    if context is None:
        raise _unavailable("the request has no context (hidden states, LM head, vocab partition)")
    if getattr(request, "log_prob_keep_mask", None) is not None:
        raise _unavailable("log_prob_keep_mask given (top-p replay renormalizes over the kept tokens; "
                           "the fused kernel normalizes over the whole vocab)")
    hidden = context.hidden
    projection, partition = context.projection, context.vocab_partition
    ids = request.target_ids.reshape(-1)
    temperature = _temperature(getattr(request, "temperature", None), int(ids.numel()))
    tp_group = getattr(request, "tensor_parallel_group", None)
    local_start, local_size = int(partition.local_start), int(partition.local_size)
    real_size, padded_size = int(partition.real_size), int(partition.padded_size)
    sharded = local_size != padded_size
    if sharded and tp_group is None:
        raise _unavailable(f"vocab is sharded (local_size={local_size} of padded_size={padded_size}) "
                           "but the request has no tensor_parallel_group")
    if request.with_entropy and (sharded or _tp_world(tp_group) > 1):
        raise _unavailable("entropy over a vocab sharded across tensor-parallel ranks is not served")
    if ids.numel() and bool((ids >= real_size).any()):
        raise _unavailable(f"target ids reach past the real vocab size {real_size}")
    try:
        call = LinearLogpCall(
            hidden, projection.weight, ids, projection.bias, temperature,
            tp_group=tp_group if sharded else None, vocab_start=local_start if sharded else 0,
            global_vocab=padded_size if sharded else None,
        )
    except (ValueError, TypeError) as exc:
        raise _unavailable(f"invalid input: {exc}") from exc
    layout = getattr(request, "token_layout", None)
    facts = {
        "temperature": temperature,
        "vocab_start": local_start,
        "vocab_local": local_size,
        "vocab_real": real_size,
        "vocab_padded": padded_size,
        "vocab_parallel": sharded,
        "token_layout": getattr(layout, "layout", None),
        "chunk_size_ignored": getattr(request, "chunk_size", None),
    }
    return call, facts


def provide(request: Any) -> LinearLogpResult:
    """The provider callable: a result for the fork's request, or ``LinearLogpProviderUnavailable``."""
    call, facts = _call(request)
    backend, impl = dispatch.select("linear_logp", **call.case())  # the public op's dispatch
    backend_id = f"{backend.id}/{backend.version}"
    logp = impl(call).unsqueeze(-1)
    entropy = (_entropy(request.logits, facts["temperature"], bool(request.with_entropy_grad))
               if request.with_entropy else None)
    provenance = {
        "op": "linear_logp",
        "implementation": f"kernels.linear_logp on {backend_id} (fp32 accumulation)",
        "entropy": "fp32 softmax of the request's logits / temperature" if request.with_entropy else None,
        "torch": torch.__version__,
        "device": str(call.hidden.device),
        "dtype": str(call.hidden.dtype).replace("torch.", ""),
        "num_tokens": int(call.hidden.shape[0]),
        **facts,
        "request_metadata": dict(getattr(request, "metadata", None) or {}),
    }
    return LinearLogpResult(logp=logp, entropy=entropy, backend_id=backend_id, contract_id=CONTRACT_ID,
                            provenance=provenance)


__all__ = [
    "BACKEND_ID",
    "CONTRACT_ID",
    "DOTTED_PATH",
    "LinearLogpProviderUnavailable",
    "LinearLogpResult",
    "provide",
]
