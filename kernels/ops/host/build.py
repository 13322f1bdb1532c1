"""Build a C++ Python extension against the installed torch with one g++ command (cached).

Why not ``torch.utils.cpp_extension.load``: it compiles ``torch/extension.h`` (pybind11 and all of
ATen's operators, a minute or more) and needs ninja. These modules include the few headers they
use (``ATen/ops/empty_like.h``, ``torch/csrc/autograd/python_variable.h``) and define their
functions with the CPython API, so one compiler run takes seconds. The result is cached by the hash
of the source and the headers beside it, the flags, the torch version and install path and the
Python ABI.

Compiler: ``$RLK_CXX``, else ``$CXX``, else ``g++`` or ``c++`` on ``PATH``.
Cache: ``$RLK_CUDA_CACHE`` (default ``~/.cache/pytest-rlk/cuda``), shared with the CUDA kernels.
Both: kernels/settings.py.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

from kernels import settings
from kernels.ops.cuda.build import build_cached, cache_dir

logger = logging.getLogger("kernels")

CXX_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")


class HostBuildError(RuntimeError):
    """No C++ compiler, or the build failed; the message carries its command and output."""


def _named_cxx() -> tuple[str, str] | None:
    """(variable, value) of the compiler the environment names, if it names one."""
    for setting in (settings.CXX, settings.TOOLCHAIN_CXX):
        named = setting.get()
        if named is not None:
            return setting.name, str(named)
    return None


def find_cxx() -> str | None:
    """The C++ compiler: the one ``$RLK_CXX`` or ``$CXX`` names (None if it is not there), else
    ``g++`` or ``c++`` on ``PATH``."""
    named = _named_cxx()
    if named is not None:
        explicit = named[1]
        return shutil.which(explicit) or (explicit if Path(explicit).is_file() else None)
    return shutil.which("g++") or shutil.which("c++")


def _torch_paths() -> tuple[Path, Path]:
    """(include directory, library directory) of the installed torch."""
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def _flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(compile flags, link flags): the libraries go after the source, or a linker that drops
    unneeded libraries (``--as-needed``) drops them before it sees the symbols they provide."""
    include, lib = _torch_paths()
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    compile_flags = (
        *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}",
        f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{sysconfig.get_paths()['include']}",
    )
    link_flags = (f"-L{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}")
    return compile_flags, link_flags


def torch_headers_present() -> bool:
    """Whether the installed torch ships the C++ headers the host modules include."""
    include, _ = _torch_paths()
    return (include / "torch" / "csrc" / "autograd" / "python_variable.h").is_file()


def extension_path(source: Path, flags: tuple[tuple[str, ...], tuple[str, ...]] | None = None) -> Path:
    """Where the module built from ``source`` (with ``flags``, default :func:`_flags`) for this
    torch and Python is cached."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    compile_flags, link_flags = _flags() if flags is None else flags
    stamp = " ".join((*compile_flags, *link_flags, torch.__version__, sys.version)).encode()
    # the headers beside the source (host_common.h) are part of every module
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + stamp).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{digest}{suffix}"


def load_extension(source: Path) -> ModuleType:
    """Import the module ``source`` defines (``PyInit_<stem>``), built now if not cached."""
    compile_flags, link_flags = flags = _flags()
    out = extension_path(source, flags)
    if not out.is_file():
        cxx = find_cxx()
        if cxx is None:
            named = _named_cxx()
            raise HostBuildError(
                f"the C++ compiler {named[0]}={named[1]!r} names is not there" if named is not None
                else "no C++ compiler found (set RLK_CXX or CXX, or put g++ on PATH)"
            )
        if not torch_headers_present():
            raise HostBuildError(f"torch's C++ headers are not installed under {_torch_paths()[0]}")
        logger.warning("kernels: building %s's host path with %s (once per torch version; cached in %s)",
                       source.stem, cxx, out.parent)
        build_cached(out, lambda partial: [cxx, *compile_flags, str(source), *link_flags, "-o", str(partial)],
                     HostBuildError)
    spec = importlib.util.spec_from_file_location(source.stem, out)
    if spec is None or spec.loader is None:
        raise HostBuildError(f"cannot import {out}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
