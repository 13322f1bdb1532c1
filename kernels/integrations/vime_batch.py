"""vime's packed micro-batch ("THD") as per-response-token tensors: the batch contract of
kernels/integrations/vime.py (its module docstring), checked with errors that name the bad entry.

``pack_responses(batch, logits [T_total, V_local] | [1, T_total, V_local])`` -> ``PackedResponses``:
logits rows [R, V_local] (R = sum of the response lengths), target ids [R] int64, lengths [B] int64,
loss mask [R], advantages and the optional old / reference / rollout log-probs [R] fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass
class PackedResponses:
    """The response tokens of a packed micro-batch, concatenated sample after sample ([R] = sum R_i)."""

    logits: torch.Tensor  # [R, V_local], rows predicting each response token
    target_ids: torch.Tensor  # [R] int64 global ids
    lengths: torch.Tensor  # [B] int64 response lengths
    loss_mask: torch.Tensor  # [R]
    old_logp: torch.Tensor | None  # [R] fp32; None when the batch carries no old log-probs
    advantages: torch.Tensor  # [R] fp32
    ref_logp: torch.Tensor | None  # [R] fp32
    rollout_logp: torch.Tensor | None  # [R] fp32


def _on_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device`` without waiting for it: a host tensor goes to a GPU through a pinned
    staging copy and an asynchronous transfer (the caching host allocator keeps the staging buffer
    until the transfer has run), where ``x.to(device)`` would wait for the device's queue."""
    if x.device == device or x.device.type != "cpu" or device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _cat(batch: dict, key: str, device: torch.device, total: int, dtype: torch.dtype | None) -> torch.Tensor:
    value = batch[key]
    if isinstance(value, torch.Tensor):
        out = value.reshape(-1)
    elif isinstance(value, Sequence) and value and all(isinstance(v, torch.Tensor) for v in value):
        out = torch.cat([v.reshape(-1) for v in value])
    else:
        raise TypeError(f"batch[{key!r}] must be a tensor or a non-empty list of tensors, got {type(value).__name__}")
    if out.numel() != total:
        raise ValueError(f"batch[{key!r}] has {out.numel()} values, expected sum(response_lengths) = {total}")
    out = _on_device(out, device)
    return out if dtype is None else out.to(dtype)


def _int_list(batch: dict, key: str) -> list[int]:
    if key not in batch:
        raise KeyError(f"batch is missing {key!r} (vime's packed batch carries it)")
    value = batch[key]
    return [int(v) for v in (value.tolist() if isinstance(value, torch.Tensor) else value)]


def pack_responses(batch: dict, logits: torch.Tensor) -> PackedResponses:
    """Map vime's packed batch + logits onto per-response-token tensors (see the module docstring)."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"logits must be [T, V] or [1, T, V] (packed THD), got shape {tuple(logits.shape)}")
        logits = logits[0]
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V] or [1, T, V] (packed THD), got shape {tuple(logits.shape)}")
    total_lengths = _int_list(batch, "total_lengths")
    response_lengths = _int_list(batch, "response_lengths")
    if len(total_lengths) != len(response_lengths):
        raise ValueError(
            f"batch['total_lengths'] ({len(total_lengths)} samples) and batch['response_lengths'] "
            f"({len(response_lengths)}) disagree"
        )
    for i, (tot, resp) in enumerate(zip(total_lengths, response_lengths)):
        if not 0 < resp < tot:
            raise ValueError(f"sample {i}: response_lengths={resp} must be in [1, total_lengths={tot})")
    num_rows = sum(total_lengths)
    if logits.shape[0] < num_rows:
        raise ValueError(f"logits has {logits.shape[0]} rows, fewer than sum(total_lengths) = {num_rows}")
    device = logits.device
    if "tokens" in batch:
        tokens = batch["tokens"].reshape(-1)
    elif "unconcat_tokens" in batch:
        tokens = torch.cat([t.reshape(-1) for t in batch["unconcat_tokens"]])
    else:
        raise KeyError("batch needs 'tokens' (packed [T_total]) or 'unconcat_tokens' (list of [total_i])")
    if tokens.numel() < num_rows:
        raise ValueError(f"batch tokens have {tokens.numel()} ids, fewer than sum(total_lengths) = {num_rows}")
    rows, targets = [], []
    end = 0
    for tot, resp in zip(total_lengths, response_lengths):
        end += tot
        rows.append(torch.arange(end - resp - 1, end - 1))
        targets.append(torch.arange(end - resp, end))
    row_index = _on_device(torch.cat(rows), device)
    target_index = _on_device(torch.cat(targets), tokens.device)
    num_resp = int(row_index.numel())
    def given(key: str) -> bool:  # vime's own test: present and non-empty
        value = batch.get(key)
        return value is not None and (value.numel() > 0 if isinstance(value, torch.Tensor) else len(value) > 0)

    has_old, has_ref, has_rollout = given("log_probs"), given("ref_log_probs"), given("rollout_log_probs")
    return PackedResponses(
        logits=logits.index_select(0, row_index),
        target_ids=_on_device(tokens.index_select(0, target_index), device).to(torch.int64),
        lengths=_on_device(torch.tensor(response_lengths, dtype=torch.int64), device),
        loss_mask=_cat(batch, "loss_masks", device, num_resp, None),
        old_logp=_cat(batch, "log_probs", device, num_resp, torch.float32) if has_old else None,
        advantages=_cat(batch, "advantages", device, num_resp, torch.float32),
        ref_logp=_cat(batch, "ref_log_probs", device, num_resp, torch.float32) if has_ref else None,
        rollout_logp=_cat(batch, "rollout_log_probs", device, num_resp, torch.float32) if has_rollout else None,
    )
