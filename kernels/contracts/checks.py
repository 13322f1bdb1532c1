"""Input checks shared by every op's contract (kernels/contracts/<op>.py).

Every check raises ``ValueError`` (or ``TypeError`` for a wrong type) with a message that names
the offending input. The contracts run them once per call, before dispatch, so every backend
sees the same accepted inputs and a fallback never changes which inputs are accepted.

Policies (stated once, here):

* **Ignore index.** A target id equal to ``ignore_index`` (default ``-100``, the value vime and
  Hugging Face use) is allowed: that row's log-prob is ``0`` and its gradient is ``0``. Any other
  id outside ``[0, V)`` is an error naming ``target_ids``; so are packed ``lengths`` /
  ``cu_seqlens`` that are negative or do not add up to T.
* **Where those value checks run.** They read tensor values. CPU tensors: here, before the launch
  (free). Device tensors, by default (``VIME_RL_KERNEL_CHECK_IDS=on``): by the op's kernels, which
  make a bad row NaN and report it through the device's error word (kernels/device_errors.py); the
  error names the input and the call and is raised at the next op call that finds the report, at
  the latest by ``kernels.raise_pending_errors()``, and no call waits for the GPU. A backend whose
  kernels do not check (the reference, peers' adapters) gets the host check before it runs
  (:func:`check_call_values`, one host sync). ``strict``: the host check always, before the launch.
  ``off``: no host check of device tensors (the kernels still report).
* **Empty inputs.** ``T == 0`` or ``V == 0`` is an error (``"... is empty"``): there is no
  meaningful log-prob or loss of nothing, and vime never produces one.
* **All-zero masks.** Allowed. A sample whose mask is all zero contributes exactly ``0`` to
  ``sum_of_sample_mean`` (its normalizer is ``clamp(sum(mask), min=1)``), never NaN.
* **NaN/Inf logits.** Default: not checked (checking reads the whole logits tensor again). A
  non-finite logit makes that row's log-prob and gradient non-finite and affects no other row
  (every row is computed independently). With ``VIME_RL_KERNEL_CHECK_FINITE=1`` (or
  ``check_finite=True`` where a function accepts it) a non-finite value raises ``ValueError``
  naming the input.
"""

from __future__ import annotations

import math

import torch

from kernels import device_errors, settings

IGNORE_INDEX = -100
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int64, torch.int32)
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
_CHECK_IDS = settings.CHECK_IDS.get
_CHECK_FINITE = settings.CHECK_FINITE.get


def _compiling() -> bool:
    # under torch.compile the data-dependent checks (which sync) would break the graph; the
    # compiled peers in the benchmarks run the math only
    return torch.compiler.is_compiling()


def ids_check_enabled() -> bool:
    """Whether device tensors' values are checked at all (``VIME_RL_KERNEL_CHECK_IDS`` not ``off``)."""
    return _CHECK_IDS() != "off" and not _compiling()


def defer_value_check(x: torch.Tensor) -> bool | None:
    """How to check the values of ``x`` (ids, lengths): False: now, on the host (CPU tensors, or
    ``strict``); True: on the device by the kernels (the default for device tensors); None: not at
    all (``off``, or under torch.compile)."""
    if _compiling():
        return None
    if x.device.type == "cpu":
        return False
    mode = _CHECK_IDS()
    if mode == "strict":
        return False
    return True if mode == "on" else None


def finite_check_enabled() -> bool:
    return _CHECK_FINITE()


def check_kl_type(kl_type: str) -> None:
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")


def check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_logits(logits: torch.Tensor, name: str = "logits", *, check_finite: bool | None = None) -> tuple[int, int]:
    """logits: [T, V] float32|bfloat16|float16, contiguous along V (stride(1) == 1), T, V > 0.
    Returns ``(T, V)``."""
    check_tensor(logits, name)
    shape = logits.shape  # read once: every read builds a torch.Size (host time of small calls)
    if len(shape) != 2:
        raise ValueError(f"{name} must be 2-D [T, V], got shape {tuple(shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"{name} dtype must be one of float32/bfloat16/float16, got {logits.dtype}")
    num_tokens, vocab = shape
    if num_tokens == 0 or vocab == 0:
        raise ValueError(f"{name} is empty: shape {tuple(shape)} (T and V must be > 0)")
    if logits.stride(1) != 1:
        raise ValueError(
            f"{name} must be contiguous along the vocab dimension (stride(1) == 1), got strides "
            f"{logits.stride()}; call .contiguous()"
        )
    if check_finite is None:
        check_finite = finite_check_enabled()
    if check_finite:
        check_all_finite(logits, name)
    return num_tokens, vocab


def check_all_finite(x: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} contains {bad} non-finite value(s) (NaN/Inf)")


def check_target_ids(
    ids: torch.Tensor,
    num_tokens: int,
    vocab_size: int,
    device: torch.device,
    ignore_index: int = IGNORE_INDEX,
    name: str = "target_ids",
) -> bool:
    """ids: [T] int64|int32 on ``device``, each in [0, vocab_size) or equal to ignore_index.

    Shapes, dtype and device are checked now; the values now (returns False) or by the kernels
    (returns True: the caller's call must be checked on the device or by :func:`check_call_values`)."""
    check_tensor(ids, name)
    if ids.dtype not in ID_DTYPES:
        raise ValueError(f"{name} dtype must be int64 or int32, got {ids.dtype}")
    if ids.shape != (num_tokens,):
        raise ValueError(f"{name} must have shape [{num_tokens}] (one id per logits row), got {tuple(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but logits are on {device}")
    defer = defer_value_check(ids)
    if defer:
        device_errors.raise_if_reported(device)  # an earlier call's report, if its kernel has written one
        return True
    if defer is False:
        check_ids_values(ids, vocab_size, ignore_index, name)
    return False


def check_ids_values(ids: torch.Tensor, vocab_size: int, ignore_index: int = IGNORE_INDEX,
                     name: str = "target_ids") -> None:
    """Every id in [0, vocab_size) or ignore_index (reads the ids: a host sync for device tensors)."""
    bad = ((ids < 0) | (ids >= vocab_size)) & (ids != ignore_index)
    if bool(bad.any()):
        first = int(ids[bad][0])
        raise ValueError(
            f"{name} has {int(bad.sum())} id(s) outside [0, {vocab_size}) (first: {first}); "
            f"only ignore_index={ignore_index} may lie outside"
        )


def check_token_vector(
    x: torch.Tensor, name: str, num_tokens: int, device: torch.device, *, floating: bool = True
) -> None:
    """x: [T] on ``device``; floating point when ``floating``."""
    check_tensor(x, name)
    if x.shape != (num_tokens,):
        raise ValueError(f"{name} must have shape [{num_tokens}], got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but expected {device}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if num_tokens == 0:
        raise ValueError(f"{name} is empty (T == 0)")


def check_mask(mask: torch.Tensor, name: str, num_tokens: int, device: torch.device) -> None:
    """mask: [T] bool or float (0/1 weights) on ``device``."""
    check_token_vector(mask, name, num_tokens, device, floating=False)
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(f"{name} must be bool or floating point, got {mask.dtype}")


def check_temperature(temperature: float) -> float:
    """temperature: a finite Python number > 0; returns it as a float."""
    if type(temperature) is float and 0.0 < temperature < math.inf:
        return temperature  # the common case, cheaply (NaN fails the comparison)
    if isinstance(temperature, torch.Tensor):
        raise TypeError("temperature must be a Python float, not a tensor")
    t = float(temperature)
    if not math.isfinite(t) or t <= 0.0:
        raise ValueError(f"temperature must be a finite float > 0, got {temperature}")
    return t


def check_lengths(
    lengths: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    num_tokens: int,
) -> bool:
    """Packed samples: ``lengths`` [B] (>= 0, summing to T) or ``cu_seqlens`` [B+1] (0, ..., T).

    Shapes and dtypes now; the values now (returns False) or by the kernels (returns True), as
    :func:`check_target_ids`."""
    if lengths is not None and cu_seqlens is not None:
        raise ValueError("pass lengths or cu_seqlens, not both")
    if lengths is not None:
        check_tensor(lengths, "lengths")
        if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise ValueError(f"lengths must be a 1-D integer tensor [B], got {lengths.dtype} {tuple(lengths.shape)}")
        if lengths.shape[0] == 0:
            raise ValueError("lengths is empty (B == 0): pass at least one sample, or neither lengths nor cu_seqlens")
        defer = defer_value_check(lengths)
        if defer is False:
            check_lengths_values(lengths, None, num_tokens)
        return bool(defer)
    if cu_seqlens is not None:
        check_tensor(cu_seqlens, "cu_seqlens")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [B+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        defer = defer_value_check(cu_seqlens)
        if defer is False:
            check_lengths_values(None, cu_seqlens, num_tokens)
        return bool(defer)
    return False


def check_lengths_values(lengths: torch.Tensor | None, cu_seqlens: torch.Tensor | None, num_tokens: int) -> None:
    """The values of ``lengths`` or ``cu_seqlens`` (reads them: a host sync for device tensors)."""
    if lengths is not None:
        # one host read for both checks
        negatives, total = torch.stack([(lengths < 0).sum(), lengths.sum()]).tolist()
        if negatives:
            raise ValueError("lengths has negative entries")
        if total != num_tokens:
            raise ValueError(f"lengths sum to {total} but there are {num_tokens} tokens")
    if cu_seqlens is not None:
        first, last, decreasing = torch.stack(
            [cu_seqlens[0], cu_seqlens[-1], (cu_seqlens[1:] < cu_seqlens[:-1]).any().to(cu_seqlens.dtype)]).tolist()
        if first != 0 or last != num_tokens:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={num_tokens}, got {first}..{last}")
        if decreasing:
            raise ValueError("cu_seqlens must be non-decreasing")


def check_call_values(call: object) -> None:
    """Run the value checks a call deferred to the device (``call.deferred``), now, on the host:
    for a backend whose kernels do not check them. A call that deferred nothing costs one attribute read."""
    if getattr(call, "deferred", 0):
        call.check_values()  # type: ignore[attr-defined]
        call.deferred = 0  # type: ignore[attr-defined]  # an int: a bool is another Triton signature
