"""Row invariance: a row's log-prob and dlogits are bitwise identical wherever it sits in the
batch, whatever the batch size and the row padding (one program per row, fixed tile order).

Runs on CPU (interpreter, V = 1031) and on GPU (compiled, V = 151936, batch up to 4096 rows)."""

from __future__ import annotations

import pytest
import torch
from rlk_op_cases import DEVICE, DTYPES, generator

import kernels
from kernels import LossConfig

ON_GPU = DEVICE == "cuda"
V = 151936 if ON_GPU else 1031
BATCHES = (64, 4096) if ON_GPU else (37,)
ROWS = 5


def _embed(rows: torch.Tensor, batch: int, offset: int, pad: int, seed: int) -> torch.Tensor:
    """``rows`` placed at ``offset`` in a batch of other random rows, with ``pad`` extra columns."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)  # on the device: GPU batches are GBs
    filler = (torch.randn(batch, V + pad, generator=gen, device=DEVICE) * 3.0).to(rows.dtype)
    filler[offset : offset + rows.shape[0], :V] = rows
    return filler[:, :V]


def _logp_and_grad(logits: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, temperature: float):
    x = logits.detach().requires_grad_()  # keeps the (possibly padded) strides
    out = kernels.logp(x, ids, temperature)
    out.backward(grad)
    return out.detach(), x.grad


def _embed_vec(values: torch.Tensor, batch: int, offset: int, fill: torch.Tensor) -> torch.Tensor:
    out = fill[:batch].clone()
    out[offset : offset + values.shape[0]] = values
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_logp_row_invariance(triton_strict, dtype_name, temperature):
    dtype = DTYPES[dtype_name]
    rows = (torch.randn(ROWS, V, generator=generator(1)) * 3.0).to(device=DEVICE, dtype=dtype)
    ids = torch.randint(0, V, (ROWS,), generator=generator(2)).to(DEVICE)
    grad = torch.randn(ROWS, generator=generator(3)).to(DEVICE)
    alone_out, alone_grad = _logp_and_grad(rows, ids, grad, temperature)
    big = max(BATCHES)
    fill_ids = torch.randint(0, V, (big,), generator=generator(4)).to(DEVICE)
    fill_grad = torch.randn(big, generator=generator(5)).to(DEVICE)
    for batch in BATCHES:
        for offset, pad in ((0, 0), (batch - ROWS, 0), (batch // 2, 64)):
            logits = _embed(rows, batch, offset, pad, seed=batch + offset)
            out, grad_all = _logp_and_grad(
                logits, _embed_vec(ids, batch, offset, fill_ids), _embed_vec(grad, batch, offset, fill_grad), temperature
            )
            where = slice(offset, offset + ROWS)
            assert torch.equal(out[where], alone_out), f"logp differs at batch={batch} offset={offset} pad={pad}"
            assert torch.equal(grad_all[where], alone_grad), f"dlogits differ at batch={batch} offset={offset} pad={pad}"


def test_grpo_loss_row_invariance(triton_strict):
    """Per-token reduction (a row's weight is its own mask): dlogits rows are batch-invariant."""
    config = LossConfig(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.1, reduction="per_token_sum")
    rows = (torch.randn(ROWS, V, generator=generator(1)) * 3.0).to(device=DEVICE, dtype=torch.bfloat16)
    per_row = {name: torch.randn(ROWS, generator=generator(10 + i)).to(DEVICE) - 2.0
               for i, name in enumerate(("old_logp", "ref_logp", "advantages"))}
    ids = torch.randint(0, V, (ROWS,), generator=generator(2)).to(DEVICE)
    mask = torch.ones(ROWS, dtype=torch.bool, device=DEVICE)

    def run(logits, ids, **kw):
        x = logits.detach().requires_grad_()
        loss, _ = kernels.grpo_loss(x, ids, config=config, **kw)
        loss.backward()
        return x.grad

    alone = run(rows, ids, loss_mask=mask, **per_row)
    big = max(BATCHES)
    fills = {name: torch.randn(big, generator=generator(20 + i)).to(DEVICE) - 2.0 for i, name in enumerate(per_row)}
    fill_ids = torch.randint(0, V, (big,), generator=generator(4)).to(DEVICE)
    for batch in BATCHES:
        offset = batch // 3
        kw = {name: _embed_vec(per_row[name], batch, offset, fills[name]) for name in per_row}
        grad = run(
            _embed(rows, batch, offset, 32, seed=batch), _embed_vec(ids, batch, offset, fill_ids),
            loss_mask=torch.ones(batch, dtype=torch.bool, device=DEVICE), **kw,
        )
        assert torch.equal(grad[offset : offset + ROWS], alone), f"grpo dlogits differ at batch={batch}"
