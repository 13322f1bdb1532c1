"""The public ops as PyTorch operators (``torch.ops.rlk.*``, registered through ``torch.library``).

Each op is a pair of custom operators, a forward and its backward, with fake (meta)
implementations and autograd registered (``register_autograd``), so ``torch.compile(...,
fullgraph=True)`` traces a function that calls ``kernels.logp`` ... without a graph break, and a
CUDA graph can capture the compiled or eager call. One module per op:

==============================  =========================================================
``torch.ops.rlk.logp``          kernels/library/logp.py (+ ``logp_backward``)
``torch.ops.rlk.ratio_kl``      kernels/library/ratio_kl.py (+ ``ratio_kl_backward``)
``torch.ops.rlk.grpo_loss``     kernels/library/grpo_loss.py (+ ``grpo_loss_backward``)
``torch.ops.rlk.linear_logp``   kernels/library/linear_logp.py (+ ``linear_logp_backward``)
==============================  =========================================================

Where the operator boundary sits (docs/kernels.md, "PyTorch operators"): the public function
checks its inputs (the contract) and calls the operator; the operator's real implementation runs
the dispatch (kernels/dispatch.py: backend choice, strict mode, fallback counts and the loud
fallback line, per call, also in compiled code) and the backend's implementation. The forward's
residuals have one layout per op whatever backend serves the call at run time (the fake
implementation cannot know which will); linear_logp's layout is an argument of its operator,
planned while the public function is traced: kernels/library/serve.py.

Under ``torch.compile`` the public functions call these operators; eager calls run the same
backend implementations without the operator layer (a custom operator's dispatch costs tens of
microseconds of host time per call, more than a small call's whole budget). The two give the same
bits (suites/op/torch_library/).

Registering them also tags torch.compile's caches with a digest of their definitions
(kernels/library/compile_cache.py): a graph compiled against other versions of these operators is
never served from Inductor's on-disk cache.
"""

from __future__ import annotations

from kernels.library.compile_cache import tag_compile_caches
from kernels.library.grpo_loss import grpo_loss_op
from kernels.library.linear_logp import linear_logp_op
from kernels.library.logp import logp_op
from kernels.library.ratio_kl import ratio_kl_op

tag_compile_caches()

NAMESPACE = "rlk"
# public op -> its forward and backward operators' names under torch.ops.rlk
OPERATORS = {op: (op, f"{op}_backward") for op in ("logp", "ratio_kl", "grpo_loss", "linear_logp")}

__all__ = ["NAMESPACE", "OPERATORS", "grpo_loss_op", "linear_logp_op", "logp_op", "ratio_kl_op"]
