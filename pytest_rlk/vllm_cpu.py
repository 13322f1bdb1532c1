"""vLLM on a CPU: what a process asks for before vLLM's CPU kernels run in it.

vLLM's CPU attention runs AMX tile instructions in bf16 where the CPU has them (Sapphire Rapids
and later), and Linux lets a process run them only after it asks (``arch_prctl``). torch asks for
the process that calls ``torch.cpu._init_amx``; vLLM itself never does, so without the request the
first attention step of an engine dies with SIGILL (exit -4 in a worker process).
"""
from __future__ import annotations


def allow_amx() -> str | None:
    """Ask for AMX in this process where the CPU has it: None when granted or not needed, else why not."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return None
    if torch.cpu._init_amx():
        return None
    return "the CPU has AMX but this process was refused its use (arch_prctl): vLLM's bf16 attention cannot run here"
