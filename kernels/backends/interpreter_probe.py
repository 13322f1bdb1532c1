"""A kernel of the constructs our kernels use (a loop over a runtime int, masked loads, a
reduction, a store), for ``kernels.backends.triton.interpreter_fails``: imported only with
``TRITON_INTERPRET=1``, so that ``triton.jit`` defines it interpreted.

    probe[(1,)](x fp32 [n] CPU, out fp32 [1] CPU, n, BLOCK=4): out[0] = sum(x)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def probe(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0))
