"""Our Triton operators: one module per op (kernel, autograd wrapper and docstring side by side; the
larger linear_logp is a package of the same parts, one file per concern).

Importing this package compiles nothing, but ``triton.jit`` decides at decoration time whether a
kernel runs compiled (CUDA) or through the CPU interpreter: ``TRITON_INTERPRET=1`` must be set
*before* the first import of ``kernels.ops`` for the kernels to run on CPU tensors.
``INTERPRETED`` records which mode this process got; the ``rlk-triton`` backend reads it to
decide whether a CPU case is supported.
"""

from __future__ import annotations

from kernels import settings

INTERPRETED = settings.TRITON_INTERPRET.get() == "1"
