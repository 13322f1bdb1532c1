"""The operators' mark on torch.compile's caches: a digest of their definitions in the cache key.

Inductor's and AOTAutograd's on-disk caches key a graph by its code, its inputs and the compile
configuration, not by what a custom operator's fake implementation returns or by its backward's
signature. A graph compiled against another version of these operators (another residual layout)
would be served again and fail on a size assertion such as ``expected size 4==6``. So the package
adds ``rlk-operators-<digest of kernels/library/*.py>`` to ``torch.compiler.config.cache_key_tag``
(PyTorch's own tag "to break caches", from ``TORCH_COMPILE_CACHE_KEY_TAG`` by default) when the
operators are registered: a change of their definitions gives new keys. A tag the user has set is
kept; ours is appended to it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

LIBRARY = Path(__file__).parent


def operators_digest(folder: Path = LIBRARY) -> str:
    """16 hex digits of sha256 over the names and bytes of ``folder``'s ``*.py`` files (sorted)."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


TAG = f"rlk-operators-{operators_digest()}"


def tag_compile_caches() -> str:
    """Adds :data:`TAG` to ``torch.compiler.config.cache_key_tag`` unless it is there; returns the tag."""
    current = torch.compiler.config.cache_key_tag
    if TAG not in current:
        torch.compiler.config.cache_key_tag = f"{current}|{TAG}" if current else TAG
    return torch.compiler.config.cache_key_tag


__all__ = ["TAG", "operators_digest", "tag_compile_caches"]
