"""Bad input found by the kernels themselves: a per-device error word, read without a host sync.

The checks that read tensor values (target ids in range, packed lengths consistent) would make the
host wait for the GPU on every call if the host ran them: the ids live on the device, and reading
them drains the launch queue. By default the kernels run them instead. A kernel that meets a bad row
(an id outside ``[0, V)`` other than ``ignore_index``, a negative length, lengths not summing to
T) makes that row's results NaN (a bad id) or its sample's weights NaN (bad packing) and writes a report into this device's **error word**: four int64 in
pinned host memory, which the kernel writes through the GPU's mapping of it (unified addressing),
so no copy is queued and a good call writes nothing:

====  ==================================================================================
word  what the kernel stores there
====  ==================================================================================
0     ``call_id * 16 + input``: which call (:func:`begin_call`) and which input (``INPUTS``)
1     ``row * 2**32 + (value mod 2**32)``: the first bad row (or sample) a program saw and its
      value, clamped to int32 (one store, so row and value come from the same program)
2     the bound the value broke (V for ids, T for lengths)
3     not a report: the incoming gradient (fp32) of the last one-read ``grpo_loss`` backward on
      this device, as ``bits(g) XOR bits(1.0)`` (``0x3F800000``) in the low 32 bits, so that the
      untouched word (0) reads as 1.0; the backward's write kernel stores it, and the next forward
      reads it (:meth:`ErrorWord.last_grad`, no wait: a stale value is only a worse prediction) to
      write dlogits for that gradient (kernels/ops/grpo_loss.py). A report's clearing leaves it alone.
====  ==================================================================================

The host reads word 0 from memory (no CUDA call, no wait) at the start of every later call of an
op on that device (:func:`raise_if_reported`) and raises :class:`DeviceInputError` naming the input
and the call; :func:`raise_pending_errors` (``kernels.raise_pending_errors()``) waits for the
device and raises for any call made so far: the vime and TRL adapters call it where they already
synchronize, so a bad batch is reported by the end of its step at the latest.

A call captured in a CUDA graph keeps its call id: a replay that meets bad input reports under
the captured call's number. The word of a device is allocated once and never freed (graphs keep
its address).

``VIME_RL_KERNEL_CHECK_IDS=strict`` keeps the checks on the host before the launch (one host sync
per check, the error raised by the call itself). CPU tensors (the reference, the Triton interpreter)
are always checked on the host before the launch: reading them costs no wait.
"""

from __future__ import annotations

import ctypes
import struct
import threading

import torch

# the input a report names (word 0 mod 16)
INPUT_TARGET_IDS, INPUT_LENGTHS, INPUT_LENGTHS_SUM, INPUT_CU_SEQLENS = 1, 2, 3, 4
LAST_GRAD = 3  # the word grpo_loss's backward stores its incoming gradient in (not a report)
FP32_ONE_BITS = 0x3F800000  # bits(1.0f): word 3 holds bits(g) XOR these, so 0 means 1.0
INPUTS = {INPUT_TARGET_IDS: "target_ids", INPUT_LENGTHS: "lengths", INPUT_LENGTHS_SUM: "lengths",
          INPUT_CU_SEQLENS: "cu_seqlens"}
CALL_ID_MASK = (1 << 24) - 1  # call ids wrap here (a kernel argument stays an int32)
_RING = 1024  # calls remembered for the message (op, logits shape)


class DeviceInputError(ValueError):
    """Bad input found on the device by an op's kernel, raised at a later call or by
    :func:`raise_pending_errors`. ``op``, ``input`` and ``call_id`` name the call and the input."""

    def __init__(self, message: str, *, op: str, input_name: str, call_id: int) -> None:
        super().__init__(message)
        self.op = op
        self.input = input_name
        self.call_id = call_id


class ErrorWord:
    """One device's error word: ``tensor`` (int64 [4], pinned host memory, the kernels' pointer
    argument; on a CPU device plain memory) and a view the host reads without torch."""

    __slots__ = ("_last_grad_bits", "device", "last_grad_ptr", "ptr", "tensor", "view")

    def __init__(self, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.device = device
        self.tensor = torch.zeros(4, dtype=torch.int64, pin_memory=pinned)
        self.ptr = self.tensor.data_ptr()
        self.view = (ctypes.c_int64 * 4).from_address(self.ptr)
        self.last_grad_ptr = self.ptr + 8 * LAST_GRAD  # the write kernel's pointer argument (word 3)
        self._last_grad_bits = ctypes.c_uint32.from_address(self.last_grad_ptr)  # its low half (little-endian)

    def last_grad(self) -> float:
        """The last one-read ``grpo_loss`` backward's incoming gradient on this device (1.0 before
        any): a read of host memory, no wait (word 3, see the table above)."""
        return decode_grad(self._last_grad_bits.value)

    def reported(self) -> bool:
        """Whether a kernel has written a report (a read of host memory: no wait)."""
        return self.view[0] != 0

    def take(self) -> DeviceInputError | None:
        """The report as an error, the word cleared; None if there is none."""
        tag = self.view[0]
        if tag == 0:
            return None
        packed, bound = self.view[1], self.view[2]
        for i in range(LAST_GRAD):
            self.view[i] = 0
        return _error(self.device, tag, packed, bound)


_words: dict[torch.device, ErrorWord] = {}
_lock = threading.Lock()
_calls: list[tuple[str, int, int] | None] = [None] * _RING  # call id % _RING -> (op, T, V)
_next_id = 0


def word_for(device: torch.device) -> ErrorWord:
    """``device``'s error word (allocated on first use, kept for the process: CUDA graphs keep its
    address). ``cuda`` without an index is the current device's word (a tensor's device always has
    one: the lookup a call makes stays one dict read)."""
    word = _words.get(device)
    if word is None:
        with _lock:
            word = _words.get(device)
            if word is None:
                indexed = device
                if device.type == "cuda" and device.index is None:
                    indexed = torch.device("cuda", torch.cuda.current_device())
                word = _words.get(indexed) or ErrorWord(indexed)
                _words[device] = _words[indexed] = word
    return word


def begin_call(op: str, num_tokens: int, vocab: int) -> int:
    """A fresh call id (1 .. 2**24 - 1, then wrapping) for a call whose kernels check its values;
    remembered with the op and the logits' shape for the message."""
    global _next_id
    call_id = _next_id = (_next_id % CALL_ID_MASK) + 1
    _calls[call_id % _RING] = (op, num_tokens, vocab)
    return call_id


def raise_if_reported(device: torch.device) -> None:
    """Raise the report of an earlier call on ``device`` if its kernel has written one by now
    (no wait; in that rare case the device is synchronized first, so the whole report is visible)."""
    word = _words.get(device)
    if word is not None and word.view[0] != 0:
        raise_pending_errors(device)


def raise_pending_errors(device: torch.device | str | int | None = None) -> None:
    """Wait for the device(s) and raise :class:`DeviceInputError` for bad input any op's kernel has
    found so far (the earliest report per device; later ones are raised by later checks).

    ``device``: one device (a ``torch.device``, ``"cuda:1"``, an index) or None for every device an
    op has run on. Where no op has run with device-side checks, it returns at once without a sync.
    Call it where the training loop synchronizes anyway (after the optimizer step, when logging a
    loss): the vime and TRL adapters do."""
    if device is None:
        words = list(_words.values())
    else:
        wanted = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if wanted.type == "cuda" and wanted.index is None:
            wanted = torch.device("cuda", torch.cuda.current_device())
        words = [w for d, w in _words.items() if d == wanted]
    for word in words:
        if word.device.type == "cuda":
            torch.cuda.synchronize(word.device)
        error = word.take()
        if error is not None:
            raise error


def encode_grad(g: float) -> int:
    """Word 3's value for an incoming gradient ``g`` (rounded to fp32): bits(g) XOR bits(1.0)."""
    return struct.unpack("<I", struct.pack("<f", g))[0] ^ FP32_ONE_BITS


def decode_grad(word: int) -> float:
    """The fp32 gradient word 3 holds (its low 32 bits; 0 is 1.0)."""
    return struct.unpack("<f", struct.pack("<I", (word & 0xFFFFFFFF) ^ FP32_ONE_BITS))[0]


def _error(device: torch.device, tag: int, packed: int, bound: int) -> DeviceInputError:
    call_id, input_code = tag >> 4, tag & 15
    input_name = INPUTS.get(input_code, f"input #{input_code}")
    row, value = packed >> 32, packed & 0xFFFFFFFF
    if value >= 1 << 31:
        value -= 1 << 32
    known = _calls[call_id % _RING] if call_id else None
    if known is not None:
        op, num_tokens, vocab = known
        call = f"kernels.{op} call #{call_id} (logits [{num_tokens}, {vocab}]) on {device}"
    else:
        op = "op"
        call = f"an op's call on {device}" if not call_id else f"op call #{call_id} on {device}"
    if input_code == INPUT_TARGET_IDS:
        what = (f"target_ids has an id outside [0, {bound}) that is not ignore_index (target_ids[{row}] = "
                f"{value}); that row's results are NaN")
    elif input_code == INPUT_LENGTHS:
        what = f"lengths has a negative entry (lengths[{row}] = {value}); that call's loss and gradients are not valid"
    elif input_code == INPUT_LENGTHS_SUM:
        what = f"lengths sum to {value} but there are {bound} tokens; that call's loss and gradients are not valid"
    else:
        what = (f"cu_seqlens must rise from 0 to T={bound} (cu_seqlens[{row}] = {value}); "
                f"that call's loss and gradients are not valid")
    message = (f"{call}: {what}. Found by the kernel without a host sync and raised at the next check; "
               f"VIME_RL_KERNEL_CHECK_IDS=strict checks before the launch (one host sync per call).")
    return DeviceInputError(message, op=op, input_name=input_name, call_id=call_id)


__all__ = [
    "INPUTS",
    "INPUT_CU_SEQLENS",
    "INPUT_LENGTHS",
    "INPUT_LENGTHS_SUM",
    "INPUT_TARGET_IDS",
    "DeviceInputError",
    "ErrorWord",
    "begin_call",
    "decode_grad",
    "encode_grad",
    "raise_if_reported",
    "raise_pending_errors",
    "word_for",
]
