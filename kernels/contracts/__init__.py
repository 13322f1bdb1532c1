"""Each op's contract, stated once: its arguments, shapes, dtypes, checks and math, one module per op.

``<Op>Call`` (a dataclass) is one checked call of the op: its fields are the op's parameters,
its docstring the shapes and dtypes, and constructing it runs every input check (``checks.py``,
the policies shared by all ops). The public API (``kernels.logp`` ...) builds the call once and
hands it to the backend that serves it; a backend's implementation of an op is a function of that
call (kernels/backends/base.py). The keyword entry points of the reference and the Triton ops are
made from their call functions by :func:`entry_point`, so the signature is written here only.

A call is read-only by contract (its fields were checked together). It is not a frozen dataclass:
a frozen one's ``__init__`` costs about 1 us more per call, and small calls are all host time.
"""

from __future__ import annotations

from kernels.contracts.call import entry_point
from kernels.contracts.checks import IGNORE_INDEX, KL_TYPES
from kernels.contracts.grpo_loss import METRIC_NAMES, REDUCTIONS, GrpoLossCall, LossConfig, LossInputs
from kernels.contracts.linear_grpo_loss import LinearGrpoLossCall
from kernels.contracts.linear_logp import LinearLogpCall
from kernels.contracts.logp import LogpCall
from kernels.contracts.ratio_kl import RatioKLCall

# op name -> its call type (the ops of the public API; backends may serve more)
CALLS = {"logp": LogpCall, "ratio_kl": RatioKLCall, "grpo_loss": GrpoLossCall, "linear_logp": LinearLogpCall}

__all__ = [
    "CALLS",
    "IGNORE_INDEX",
    "KL_TYPES",
    "METRIC_NAMES",
    "REDUCTIONS",
    "GrpoLossCall",
    "LinearGrpoLossCall",
    "LinearLogpCall",
    "LogpCall",
    "LossConfig",
    "LossInputs",
    "RatioKLCall",
    "entry_point",
]
