"""linear_logp provider for vime's fork: ``--linear-logp-provider kernels.integrations.linear_logp_provider.provide``.

The fork loads a provider callable by dotted path (``pkg.module.callable``) and calls it with one
request object; the result carries log-probs ``[T, 1]`` fp32 on the hidden states' device, a backend
id, a contract id and provenance (docs/linear_logp.md, ../shared/docs/vime-facts.md).

vime cannot be installed here, so the request/result below are dataclasses that *mirror the
documented contract*; ``provide`` reads the request by attribute access only (duck typing), so the
fork's own request objects work as long as they carry the documented fields. Where the fork's
attribute spelling is not known for sure, a few spellings are accepted (``_FIELD_ALIASES``).

Modes (``request.mode``, else ``request.metadata["mode"]``, else ``"auto"``; the fork's
``--linear-logp-provider-mode``):
* ``auto``: a request this provider cannot serve returns ``LinearLogpUnavailable(reason=...)``, the
  explicit "unavailable" signal on which the fork falls back to its native path (and logs the reason).
* ``strict``: the same situations raise ``LinearLogpProviderUnavailable`` naming the reason; the
  result must also have non-empty ids and, when gradients are being recorded, log-probs connected
  to autograd.

A served request runs the public ``linear_logp`` op through :mod:`kernels.dispatch`, like every
other hook: ``VIME_RL_KERNEL``, the backend switch, strict mode and the fallback counters apply,
and the result's ``backend_id`` names the backend that computed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import dispatch
from kernels.contracts import LinearLogpCall
from kernels.ops import INTERPRETED

# What to pass as --linear-logp-provider: the fork's form is pkg.module.callable (last dot = callable).
DOTTED_PATH = "kernels.integrations.linear_logp_provider.provide"
BACKEND_ID = "rlk-triton/0.1.0"  # the backend this provider serves from when the kernels are on
CONTRACT_ID = "vime.linear_logp.provider/v1"
MODES = ("auto", "strict")
LAYOUTS = ("single", "zigzag", "allgather")


class LinearLogpProviderUnavailable(RuntimeError):
    """Raised in strict mode where auto mode returns ``LinearLogpUnavailable``."""


# ---------------------------------------------------------------------------------------------
# Request / result: dataclasses mirroring the fork's documented provider contract
# ---------------------------------------------------------------------------------------------


@dataclass
class VocabPartition:
    """This rank's rows of the LM head: global ids [local_start, local_start + local_size)."""

    local_start: int
    local_size: int
    real_vocab_size: int  # tokenizer vocab; target ids must be below it
    padded_vocab_size: int  # Megatron's padded vocab (all shards together); padded rows take part in the softmax


@dataclass
class Projection:
    """The output layer (LM head) weight [V_local, H] and optional bias [V_local]; not the embedding."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None = None


@dataclass
class LinearLogpContext:
    hidden_states: torch.Tensor  # [T, H]
    projection: Projection
    vocab_partition: VocabPartition


@dataclass
class TokenLayout:
    world_size: int = 1
    rank: int = 0
    layout: str = "single"  # single | zigzag | allgather


@dataclass
class LinearLogpRequest:
    target_ids: torch.Tensor  # [T] global ids
    context: LinearLogpContext
    temperature: float = 1.0
    tp_group: Any = None
    token_layout: TokenLayout = field(default_factory=TokenLayout)
    with_entropy: bool = False
    with_entropy_grad: bool = False
    chunk_size: int | None = None
    keep_mask: torch.Tensor | None = None  # [T] bool/float: rows outside it get log-prob 0
    metadata: dict = field(default_factory=dict)
    mode: str = "auto"


@dataclass
class LinearLogpResult:
    log_probs: torch.Tensor  # [T, 1] float32, same device as the hidden states
    backend_id: str
    contract_id: str
    provenance: dict
    entropy: torch.Tensor | None = None  # never computed here (entropy requests are declined)
    available: bool = True


@dataclass
class LinearLogpUnavailable:
    """The explicit "unavailable" signal (auto mode): the fork falls back to its native path."""

    reason: str
    backend_id: str = BACKEND_ID
    contract_id: str = CONTRACT_ID
    available: bool = False


# ---------------------------------------------------------------------------------------------
# Duck-typed access
# ---------------------------------------------------------------------------------------------

_MISSING = object()
_FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_states": ("hidden_states", "hidden"),
    "projection": ("projection", "lm_head", "output_layer"),
    "vocab_partition": ("vocab_partition", "partition"),
    "local_start": ("local_start", "vocab_start", "local_vocab_start"),
    "local_size": ("local_size", "vocab_size_local", "local_vocab_size"),
    "real_vocab_size": ("real_vocab_size", "vocab_size"),
    "padded_vocab_size": ("padded_vocab_size",),
    "target_ids": ("target_ids", "targets", "token_ids"),
    "keep_mask": ("keep_mask", "logprob_keep_mask"),
    "token_layout": ("token_layout", "layout_info"),
}


def _get(obj: Any, name: str, default: Any = _MISSING) -> Any:
    for attr in _FIELD_ALIASES.get(name, (name,)):
        value = obj.get(attr, _MISSING) if isinstance(obj, dict) else getattr(obj, attr, _MISSING)
        if value is not _MISSING:
            return value
    if default is _MISSING:
        raise _Unservable(f"request has no field {name!r} (looked for {', '.join(_FIELD_ALIASES.get(name, (name,)))})")
    return default


class _Unservable(Exception):
    """Internal: the request cannot be served; the message is the reason."""


def request_mode(request: Any) -> str:
    mode = getattr(request, "mode", None) or (getattr(request, "metadata", None) or {}).get("mode") or "auto"
    mode = str(mode).lower()
    if mode not in MODES:
        raise ValueError(f"linear_logp provider mode must be one of {MODES}, got {mode!r}")
    return mode


def _kernels_runnable(device: torch.device) -> str | None:
    if device.type == "cuda":
        return None
    if device.type == "cpu" and INTERPRETED:
        return None
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 set before import, on CPU); hidden states are on {device}"


def _plan(request: Any) -> dict:
    """The checked ``linear_logp`` call (``plan["call"]``) and what the result reports, or
    ``_Unservable`` with the reason."""
    if _get(request, "with_entropy", False) or _get(request, "with_entropy_grad", False):
        raise _Unservable("entropy requested (with_entropy/with_entropy_grad); linear_logp computes log-probs only")
    layout = _get(request, "token_layout", None)
    if layout is not None:
        kind = str(_get(layout, "layout", "single"))
        if kind != "single":
            raise _Unservable(f"token layout {kind!r} is not supported (only 'single')")
    temperature = float(_get(request, "temperature", 1.0))
    if not temperature > 0.0:
        raise _Unservable(f"temperature <= 0 ({temperature})")
    context = _get(request, "context")
    hidden = _get(context, "hidden_states")
    projection = _get(context, "projection")
    weight = _get(projection, "weight", None)
    if weight is None:
        raise _Unservable("LM-head weight unavailable (projection.weight is None)")
    bias = _get(projection, "bias", None)
    partition = _get(context, "vocab_partition")
    local_start = int(_get(partition, "local_start"))
    local_size = int(_get(partition, "local_size"))
    real_vocab = int(_get(partition, "real_vocab_size"))
    padded_vocab = int(_get(partition, "padded_vocab_size"))
    if not isinstance(hidden, torch.Tensor):
        raise _Unservable(f"hidden states must be a torch.Tensor, got {type(hidden).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise _Unservable(f"LM-head weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.shape[0] != local_size:
        raise _Unservable(
            f"LM-head weight has shape {tuple(weight.shape)} but the vocab partition says local_size={local_size}"
        )
    ids = _get(request, "target_ids")
    if not isinstance(ids, torch.Tensor) or ids.numel() == 0:
        raise _Unservable("target ids are empty")
    ids = ids.reshape(-1)
    if bool((ids >= real_vocab).any()):
        raise _Unservable(f"target ids reach past the real vocab size {real_vocab}")
    device_problem = _kernels_runnable(hidden.device)
    if device_problem:
        raise _Unservable(device_problem)
    tp_group = _get(request, "tp_group", None)
    sharded = local_size != padded_vocab
    if sharded and tp_group is None:
        raise _Unservable(f"vocab is sharded (local_size={local_size} of {padded_vocab}) but no TP group was given")
    plan = {
        "hidden": hidden.reshape(-1, hidden.shape[-1]),
        "weight": weight,
        "bias": bias,
        "temperature": temperature,
        "tp_group": tp_group if sharded else None,
        "vocab_start": local_start if sharded else 0,
    }
    try:
        plan["call"] = LinearLogpCall(
            plan["hidden"], weight, ids, bias, temperature, tp_group=plan["tp_group"],
            vocab_start=plan["vocab_start"], global_vocab=padded_vocab if sharded else None,
        )
    except (ValueError, TypeError) as exc:
        raise _Unservable(f"invalid input: {exc}") from exc
    return plan


def _provenance(request: Any, plan: dict, backend_id: str) -> dict:
    hidden = plan["hidden"]
    import triton

    return {
        "op": "linear_logp",
        "implementation": f"kernels.linear_logp on {backend_id} (fp32 accumulation)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(hidden.device),
        "dtype": str(hidden.dtype).replace("torch.", ""),
        "num_tokens": int(hidden.shape[0]),
        "vocab_local": int(plan["weight"].shape[0]),
        "vocab_start": plan["vocab_start"],
        "vocab_parallel": plan["tp_group"] is not None,
        "temperature": plan["temperature"],
        "chunk_size_ignored": _get(request, "chunk_size", None),
        "request_metadata": dict(_get(request, "metadata", None) or {}),
    }


def provide(request: Any) -> LinearLogpResult | LinearLogpUnavailable:
    """The provider callable. Returns a result, or (auto) the unavailable signal; strict raises."""
    mode = request_mode(request)
    try:
        plan = _plan(request)
    except _Unservable as exc:
        if mode == "strict":
            raise LinearLogpProviderUnavailable(f"RL-Kernel linear_logp is unavailable: {exc}") from None
        return LinearLogpUnavailable(reason=str(exc))
    call = plan["call"]
    backend, impl = dispatch.select("linear_logp", **call.case())  # the public op's dispatch
    backend_id = f"{backend.id}/{backend.version}"
    logp = impl(call)
    keep = _get(request, "keep_mask", None)
    if keep is not None:
        logp = torch.where(keep.reshape(-1).to(torch.bool), logp, torch.zeros_like(logp))
    log_probs = logp.unsqueeze(-1)
    if mode == "strict":
        wants_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (plan["hidden"], plan["weight"], plan["bias"])
        )
        if wants_grad and log_probs.grad_fn is None:
            raise LinearLogpProviderUnavailable("log-probs are not connected to autograd")
    return LinearLogpResult(
        log_probs=log_probs, backend_id=backend_id, contract_id=CONTRACT_ID,
        provenance=_provenance(request, plan, backend_id),
    )


__all__ = [
    "BACKEND_ID",
    "DOTTED_PATH",
    "CONTRACT_ID",
    "LinearLogpContext",
    "LinearLogpProviderUnavailable",
    "LinearLogpRequest",
    "LinearLogpResult",
    "LinearLogpUnavailable",
    "Projection",
    "TokenLayout",
    "VocabPartition",
    "provide",
    "request_mode",
]
