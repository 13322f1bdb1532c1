"""ratio and KL from per-token log-probs: one elementwise Triton kernel each way + autograd.

The op's arguments, shapes and checks: kernels/contracts/ratio_kl.py (``RatioKLCall``):
``ratio = exp(logp - old) * mask``; ``kl = compute_kl(logp, ref, kl_type, use_unbiased_kl) * mask``.
Backward (to ``logp`` only): ``g_ratio * ratio + g_kl * dkl/dlogp * mask``, recomputed from the
inputs (nothing [T]-sized is saved beyond the inputs). ``kl_value_and_grad`` is the KL math shared
with the fused GRPO loss kernel. The kernels read the mask in its own dtype (no converted copy).

Host time: the op is elementwise, so its host time weighs: a call of a few tokens is all host time,
and a forward+backward of millions of tokens (~0.2 ms on the GPU) is host-bound through
autograd.Function. A common-case call (plain contiguous CUDA tensors on the current device, the
usual dtypes; with a gradient, 16-byte aligned inputs) takes the host path
``kernels/ops/host/ratio_kl_elementwise.cpp``: one C++ call that checks, allocates and launches the
forward kernel this module compiled and registered for the same key, and where a gradient is
wanted attaches a C++ autograd node that launches the registered backward kernel. Anything else,
or a call whose kernels are not registered yet, runs the Python path below (which launches through
``kernels.launch``, and skips ``autograd.Function`` when there is nothing to differentiate).
``host_first(...)`` tries the host path on the public arguments, before the contract's Python checks
(it checks what it relies on itself and declines the rest, whose checks then name the bad input):
the backend offers it to the public ``kernels.ratio_kl`` (kernels/backends/base.py), and
``ratio_kl(...)`` here runs it first too; ``ratio_kl_call(call)`` serves an already checked call
(the dispatched path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launch
from kernels.contracts import KL_TYPES, RatioKLCall
from kernels.contracts.checks import check_kl_type
from kernels.launch import I32_MAX, CachedLaunch
from kernels.ops.host import HostModule

ELEMENTWISE_BLOCK = 1024
_KL_CODES = {name: code for code, name in enumerate(KL_TYPES)}


def kl_type_code(kl_type: str) -> int:
    """Constexpr code of a KL type for the kernels (index in KL_TYPES)."""
    code = _KL_CODES.get(kl_type) if isinstance(kl_type, str) else None
    if code is None:
        check_kl_type(kl_type)  # raises, naming the accepted types
    return code


@triton.jit
def kl_value_and_grad(logp, ref_logp, old_logp, KL_TYPE: tl.constexpr, UNBIASED: tl.constexpr):
    """(kl, d kl / d logp) for KL_TYPE 0 k1, 1 k2, 2 k3, 3 low_var_kl (k3 clamped to +-10)."""
    r = logp - ref_logp
    if KL_TYPE == 0:
        kl = r
        dkl = r * 0.0 + 1.0  # same shape as r, scalar or block
    elif KL_TYPE == 1:
        kl = r * r / 2.0
        dkl = r
    else:
        e = tl.exp(-r)
        kl = e - 1.0 + r
        dkl = 1.0 - e
        if KL_TYPE == 3:
            # torch.clamp passes the gradient on the closed interval [-10, 10]
            inside = (kl >= -10.0) & (kl <= 10.0)
            dkl = tl.where(inside, dkl, 0.0)
            kl = tl.minimum(tl.maximum(kl, -10.0), 10.0)
    if UNBIASED:
        w = tl.exp(logp - old_logp)
        dkl = w * dkl + w * kl
        kl = kl * w
    return kl, dkl


@triton.jit
def _ratio_kl_fwd_kernel(
    logp_ptr, old_ptr, ref_ptr, mask_ptr, ratio_ptr, kl_ptr, n,
    BLOCK: tl.constexpr, KL_TYPE: tl.constexpr, UNBIASED: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    logp = tl.load(logp_ptr + offs, mask=valid, other=0.0)
    old = tl.load(old_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    ref = tl.load(ref_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    m = tl.load(mask_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    kl, _ = kl_value_and_grad(logp, ref, old, KL_TYPE, UNBIASED)
    tl.store(ratio_ptr + offs, tl.exp(logp - old) * m, mask=valid)
    tl.store(kl_ptr + offs, kl * m, mask=valid)


@triton.jit
def _ratio_kl_bwd_kernel(
    logp_ptr, old_ptr, ref_ptr, mask_ptr, g_ratio_ptr, g_kl_ptr, grad_ptr, n,
    BLOCK: tl.constexpr, KL_TYPE: tl.constexpr, UNBIASED: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    logp = tl.load(logp_ptr + offs, mask=valid, other=0.0)
    old = tl.load(old_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    ref = tl.load(ref_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    m = tl.load(mask_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    g_ratio = tl.load(g_ratio_ptr + offs, mask=valid, other=0.0)
    g_kl = tl.load(g_kl_ptr + offs, mask=valid, other=0.0)
    _, dkl = kl_value_and_grad(logp, ref, old, KL_TYPE, UNBIASED)
    grad = (g_ratio * tl.exp(logp - old) + g_kl * dkl) * m
    tl.store(grad_ptr + offs, grad, mask=valid)


def _grid(n: int) -> tuple[int]:
    return ((n + ELEMENTWISE_BLOCK - 1) // ELEMENTWISE_BLOCK,)


_FWD = CachedLaunch(_ratio_kl_fwd_kernel)
_BWD = CachedLaunch(_ratio_kl_bwd_kernel)
_HOST = HostModule("ratio_kl_elementwise")


def _forward(logp, old_logp, ref_logp, mask, kl_code, unbiased):
    """(ratio, kl), fresh fp32 [T] each. The launch key holds everything Triton specializes the
    kernel on (kernels/launch.py): the inputs' dtypes, 16-byte alignment, device and type; the
    outputs are fresh allocations like ``logp`` (aligned, fp32: validated); ``n`` as Triton sees an
    int (== 1, a multiple of 16, 32-bit); the constexprs."""
    n = logp.shape[0]
    ratio = torch.empty_like(logp)
    kl = torch.empty_like(logp)
    pointers = logp.data_ptr(), old_logp.data_ptr(), ref_logp.data_ptr(), mask.data_ptr()
    key = (type(logp), type(old_logp), type(ref_logp), type(mask), logp.get_device(), old_logp.dtype,
           ref_logp.dtype, mask.dtype, pointers[0] % 16 == 0, pointers[1] % 16 == 0, pointers[2] % 16 == 0,
           pointers[3] % 16 == 0, n == 1, n % 16 == 0, n <= I32_MAX, kl_code, unbiased)
    grid = _grid(n)
    direct = _FWD.direct(key)
    if direct is not None:
        direct(grid[0], *pointers, ratio.data_ptr(), kl.data_ptr(), n)
        return ratio, kl
    cache_key = _FWD.launch_keyed(
        key, grid, logp, old_logp, ref_logp, mask, ratio, kl, n,
        BLOCK=ELEMENTWISE_BLOCK, KL_TYPE=kl_code, UNBIASED=unbiased,
    )
    if cache_key is not None:
        _register_host(cache_key, logp, old_logp, ref_logp, mask, kl_code, unbiased)
    return ratio, kl


def _register_host(cache_key: tuple, logp, old_logp, ref_logp, mask, kl_code, unbiased) -> None:
    """Give the host path the forward kernel these inputs just launched (kept under the host path's
    own key, which must tell apart what Triton specializes: LaunchKeyError if it maps two kernels
    onto one key; every keyed call checks that under RLK_VERIFY_LAUNCH_KEYS=1)."""
    native = _FWD.native_launch(cache_key)  # a compiled (so CUDA) kernel, or None
    module = _HOST.registry() if native is not None else None  # built on the first registration
    if module is not None:
        stored = module.register_forward(logp, old_logp, ref_logp, mask, kl_code, unbiased, ELEMENTWISE_BLOCK, native)
        _HOST.registered(stored, f"this call's forward kernel {cache_key[1]!r} (T={logp.shape[0]}, dtypes "
                                 f"{old_logp.dtype}/{ref_logp.dtype}/{mask.dtype})")


def host_path() -> str:
    """Which path common-case calls take now: ``c++`` (the host path holds kernels; its module's
    ``served()`` counts the calls it took), or ``python`` and why not (for benchmark tags)."""
    return _HOST.path_label()


class RatioKLFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, ref_logp, mask, kl_code, unbiased):  # type: ignore[override]
        ratio, kl = _forward(logp, old_logp, ref_logp, mask, kl_code, unbiased)
        ctx.save_for_backward(logp, old_logp, ref_logp, mask)
        ctx.kl_code, ctx.unbiased = kl_code, unbiased
        return ratio, kl

    @staticmethod
    def backward(ctx, g_ratio, g_kl):  # type: ignore[override]
        grad = ratio_kl_backward(*ctx.saved_tensors, g_ratio, g_kl, ctx.kl_code, ctx.unbiased)
        return grad, None, None, None, None, None


def ratio_kl_backward(logp, old_logp, ref_logp, mask, g_ratio, g_kl, kl_code: int, unbiased: bool) -> torch.Tensor:
    """d/dlogp fp32 [T] from the forward's inputs (contiguous) and the outputs' gradients (None: zero)."""
    g_ratio = torch.zeros_like(logp) if g_ratio is None else g_ratio.contiguous()
    g_kl = torch.zeros_like(logp) if g_kl is None else g_kl.contiguous()
    grad = torch.empty_like(logp)
    n = logp.shape[0]
    native = _BWD.launch_native(
        _grid(n), logp, old_logp, ref_logp, mask, g_ratio, g_kl, grad, n,
        BLOCK=ELEMENTWISE_BLOCK, KL_TYPE=kl_code, UNBIASED=unbiased,
    )
    module = _HOST.registry() if native is not None else None
    if module is not None:
        # the host path's node launches this kernel for later calls (aligned inputs only: None otherwise)
        _HOST.registered(module.register_backward(logp, old_logp, ref_logp, mask, g_ratio, g_kl, kl_code, unbiased,
                                                  ELEMENTWISE_BLOCK, native), "this call's backward kernel")
    return grad


def _host_path(logp, old_logp, ref_logp, mask, code: int, unbiased: bool):
    """(ratio, kl) from the C++ host path, or None where it declines (or holds no kernel yet)."""
    host_forward = _HOST.forward
    if host_forward is None or launch.fast_path_now() is None:
        return None
    return host_forward(logp, old_logp, ref_logp, mask, code, unbiased)


def host_first(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_type: str = "low_var_kl",
    use_unbiased_kl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``RatioKLCall``'s arguments -> (ratio, kl) from the C++ host path, or None where it declines
    (the caller then builds and checks the call). It accepts a subset of what the contract accepts
    and checks it field by field (the host path's contract, kernels/ops/host/ratio_kl_elementwise.cpp),
    so its result is the checked call's; an unknown ``kl_type`` raises as the contract does."""
    return _host_path(logp, old_logp, ref_logp, mask, kl_type_code(kl_type), bool(use_unbiased_kl))


def ratio_kl_call(call: RatioKLCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, kl) fp32 [T] on the Triton kernels (the host path first), autograd to ``logp``."""
    code = kl_type_code(call.kl_type)
    out = _host_path(call.logp, call.old_logp, call.ref_logp, call.mask, code, call.use_unbiased_kl)
    if out is not None:
        return out
    return _ratio_kl(call.logp, call.old_logp, call.ref_logp, call.mask, code, call.use_unbiased_kl)


def _ratio_kl(logp, old_logp, ref_logp, mask, code: int, unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = (logp.contiguous(), old_logp.contiguous(), ref_logp.contiguous(), mask.contiguous(), code, unbiased)
    if not (logp.requires_grad and torch.is_grad_enabled()):
        return _forward(*inputs)  # nothing to differentiate: no autograd.Function bookkeeping
    return RatioKLFunction.apply(*inputs)


def ratio_kl(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_type: str = "low_var_kl",
    use_unbiased_kl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RatioKLCall``'s arguments (kernels/contracts/ratio_kl.py) -> (ratio, kl) fp32 [T]. The host
    path runs before the contract's checks: a direct call of a few tokens is all host time."""
    out = host_first(logp, old_logp, ref_logp, mask, kl_type=kl_type, use_unbiased_kl=use_unbiased_kl)
    if out is not None:
        return out
    call = RatioKLCall(logp, old_logp, ref_logp, mask, kl_type=kl_type, use_unbiased_kl=use_unbiased_kl)
    return _ratio_kl(call.logp, call.old_logp, call.ref_logp, call.mask, kl_type_code(kl_type), call.use_unbiased_kl)
