"""``example-torch``: a real backend built from torch ops other than the reference's.

logp uses ``-cross_entropy`` (the reference uses max-shift + logsumexp + gather), ratio_kl uses
``expm1``, linear_logp an fp32 ``F.linear`` + ``-cross_entropy``. It declares what it does not do:
no ``grpo_loss``, no fp16, no vocab parallelism; the suite skips those cases with these reasons.

Each implementation takes the op's checked call (``kernels.contracts.LogpCall``, ...): its fields
are the public function's arguments, already checked, so the backend does the math only.

``make_broken_backend`` returns the same backend with a deliberate error in one logp element
(``example-broken``): the suite's report must say where it disagrees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernels.backends.base import BaseBackend, Capabilities
from kernels.contracts import LinearLogpCall, LogpCall, RatioKLCall


def logp(call: LogpCall) -> torch.Tensor:
    """logits [T, V] fp32|bf16 -> fp32 [T]; rows with ``ignore_index`` give 0."""
    if call.tp_group is not None:
        raise ValueError("example-torch: logp has no vocab-parallel form (tp_group given)")
    z = call.logits.float() / call.temperature
    return -F.cross_entropy(z, call.target_ids.long(), reduction="none", ignore_index=call.ignore_index)


def ratio_kl(call: RatioKLCall) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] fp32 -> (ratio, kl), masked."""
    m = call.mask.float()
    log_ratio = call.logp - call.old_logp
    r = call.logp - call.ref_logp
    if call.kl_type == "k1":
        kl = r
    elif call.kl_type == "k2":
        kl = 0.5 * r.square()
    else:  # k3 and low_var_kl (the contract admits nothing else)
        kl = torch.expm1(-r) + r
        if call.kl_type == "low_var_kl":
            kl = kl.clamp(-10.0, 10.0)
    if call.use_unbiased_kl:
        kl = kl * log_ratio.exp()
    return log_ratio.exp() * m, kl * m


def linear_logp(call: LinearLogpCall) -> torch.Tensor:
    """hidden [T, H], weight [V, H] -> fp32 [T] (fp32 matmul)."""
    if call.tp_group is not None:
        raise ValueError("example-torch: linear_logp has no vocab-parallel form (tp_group given)")
    bias = None if call.bias is None else call.bias.float()
    z = F.linear(call.hidden.float(), call.weight.float(), bias) / call.temperature
    return -F.cross_entropy(z, call.target_ids.long(), reduction="none")


class ExampleBackend(BaseBackend):
    id = "example-torch"
    version = "1.0.0"
    capabilities = Capabilities(
        ops=frozenset({"logp", "ratio_kl", "linear_logp"}),
        dtypes=frozenset({torch.float32, torch.bfloat16}),
        tp=False,
    )
    _impls: dict[str, Callable[..., Any]] = {"logp": logp, "ratio_kl": ratio_kl, "linear_logp": linear_logp}

    def get(self, op: str) -> Callable[..., Any]:
        if op not in self._impls:
            raise KeyError(f"{self.id} does not implement {op!r}")
        return self._impls[op]


def make_backend() -> ExampleBackend:
    return ExampleBackend()


def _broken_logp(call: LogpCall) -> torch.Tensor:
    out = logp(call)
    return out + torch.nn.functional.one_hot(torch.tensor(2), out.shape[0]).to(out) * 1e-3


class BrokenExampleBackend(ExampleBackend):
    """example-torch with logp off by 1e-3 at row 2 (for testing the disagreement report)."""

    id = "example-broken"
    _impls = {**ExampleBackend._impls, "logp": _broken_logp}


def make_broken_backend() -> BrokenExampleBackend:
    return BrokenExampleBackend()
