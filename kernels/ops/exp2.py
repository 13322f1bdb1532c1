"""The softmax sweeps' exponentials in base 2 (Triton device functions and constants).

exp(z - m) is formed as exp2(fma(z, log2e, -h)) with h = m * log2e rounded: one FFMA and one ex2
per element where exp's own lowering takes an FADD, an FMUL and an ex2. Every such term carries the
factor 2**(m log2e - h); :func:`exp2_correction` takes it out of a sum (or of a coefficient) once.
Users: kernels/ops/logp.py (row_max_sumexp, row_write_grad) and kernels/ops/linear_logp/kernels.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def exp2_correction(m, h):
    """1 - (m log2e - h) ln 2: takes out the factor 2**(m log2e - h) that every exp2(fma(z, log2e,
    -h)) carries when h is m log2e rounded (the residual m log2e - h is exact in one FMA)."""
    return 1.0 - tl.fma(m, LOG2E, -h) * LN2
