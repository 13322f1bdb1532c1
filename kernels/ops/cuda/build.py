"""Build CUDA C++ kernels with nvcc and launch them through the CUDA driver API (ctypes).

Why not ``torch.utils.cpp_extension``: it compiles PyTorch's C++ headers (a minute or more on
every fresh machine) to wrap a launch we can make ourselves. Here a ``.cu`` file of
``extern "C"`` kernels becomes a fatbin (sm_90 machine code + compute_90 PTX for newer GPUs) in
a few seconds, cached on disk by the hash of the source and the flags; the driver loads it into
the context PyTorch uses, and :func:`launch` passes plain pointers and scalars on PyTorch's
current stream (so CUDA-graph capture records it like any other launch).

``nvcc``: ``$RLK_NVCC`` if set, else the one on ``PATH``, else ``$CUDA_HOME/bin/nvcc``.
Cache: ``$RLK_CUDA_CACHE`` (default ``~/.cache/pytest-rlk/cuda``). Both: kernels/settings.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from kernels import settings

NVCC_FLAGS = (
    "-O3", "-std=c++17", "-lineinfo",
    "-gencode", "arch=compute_90,code=sm_90",
    "-gencode", "arch=compute_90,code=compute_90",
)
# cuFuncSetAttribute: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, _PREFERRED_SHARED_MEMORY_CARVEOUT
_ATTR_MAX_DYNAMIC_SHARED = 8
_ATTR_SHARED_CARVEOUT = 9


class CudaBuildError(RuntimeError):
    """nvcc is missing or failed; the message carries its command and output."""


def find_nvcc() -> str | None:
    explicit = settings.NVCC.get()
    if explicit is not None:
        return str(explicit) if explicit.is_file() else None
    found = shutil.which("nvcc")
    if found:
        return found
    home = settings.CUDA_HOME.get() or settings.CUDA_PATH.get()
    if home and (home / "bin" / "nvcc").is_file():
        return str(home / "bin" / "nvcc")
    return None


def cache_dir() -> Path:
    return settings.CUDA_CACHE.get().expanduser()


def fatbin_path(source: Path, defines: tuple[str, ...] = ()) -> Path:
    """Where the fatbin of ``source`` (built with NVCC_FLAGS and ``-D`` ``defines``) is cached."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(NVCC_FLAGS + defines).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{digest}.fatbin"


def compile_fatbin(source: Path, defines: tuple[str, ...] = ()) -> Path:
    """The cached fatbin of ``source``, compiled now if absent (raises :class:`CudaBuildError`).
    ``defines``: ``NAME=VALUE`` macros passed as ``-D`` (part of the cache key)."""
    out = fatbin_path(source, defines)
    if out.is_file():
        return out
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaBuildError("nvcc not found (set RLK_NVCC, put nvcc on PATH or set CUDA_HOME)")
    return build_cached(
        out, lambda partial: [nvcc, "-fatbin", *NVCC_FLAGS, *(f"-D{d}" for d in defines), "-o", str(partial),
                              str(source)]
    )


def build_cached(out: Path, command: Callable[[Path], list[str]], error: type[Exception] = CudaBuildError) -> Path:
    """Build ``out`` (callers look in the cache first) by running ``command(partial)``, a compiler
    writing ``partial``, then renaming it into place; ``error`` (with the command and the
    compiler's output) if it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = command(partial)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise error(f"{Path(cmd[0]).name} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    partial.replace(out)  # atomic: a concurrent process sees the whole file or none
    return out


class _Driver:
    """The few driver entry points we use, checked: every non-zero CUresult raises with its name."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._primary: dict[int, ctypes.c_void_p] = {}

    def check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"CUDA driver {what} failed: {name.value.decode() if name.value else result}")

    def ensure_context(self, device: int) -> None:
        """Make ``device``'s primary context (the one PyTorch's runtime uses) current on this thread."""
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        primary = self._primary.get(device)
        if primary is not None and ctx.value == primary.value:
            return
        if primary is None:
            handle = ctypes.c_int()
            self.check(self.lib.cuDeviceGet(ctypes.byref(handle), device), f"cuDeviceGet({device})")
            primary = ctypes.c_void_p()
            # retained once per process and device, never released: it lives as long as PyTorch's
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), handle), "cuDevicePrimaryCtxRetain")
            self._primary[device] = primary
            if ctx.value == primary.value:
                return
        self.check(self.lib.cuCtxSetCurrent(primary), "cuCtxSetCurrent")


_driver: _Driver | None = None
_lock = threading.RLock()  # load_module holds it while CudaModule takes the driver


def driver() -> _Driver:
    global _driver
    with _lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


# a kernel argument's C type in a signature: device pointer, int32, int64, float
_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}


class CudaKernel:
    """One ``extern "C"`` kernel of a loaded module, with its argument signature."""

    def __init__(self, handle: ctypes.c_void_p, name: str, signature: tuple[str, ...], device: int) -> None:
        self.handle = handle
        self.device = device
        self.name = name
        self.signature = signature
        self._max_dynamic_smem = 48 * 1024
        # one argument buffer per thread, filled in place at each launch (building the ctypes
        # values and the pointer array anew costs ~10 us of host time per launch)
        self._local = threading.local()

    def launch(self, grid: int, block: int, shared_bytes: int, args: tuple, stream: int) -> None:
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name} takes {len(self.signature)} arguments, got {len(args)}")
        drv = driver()
        # the function belongs to its device's context: make that context current (a process that
        # drives several GPUs from one thread may have another device's context current now)
        drv.ensure_context(self.device)
        if shared_bytes > self._max_dynamic_smem:
            self._max_dynamic_smem = shared_bytes
            drv.check(drv.lib.cuFuncSetAttribute(self.handle, _ATTR_MAX_DYNAMIC_SHARED, shared_bytes),
                      f"cuFuncSetAttribute({self.name}, max dynamic shared memory {shared_bytes})")
            # all of L1/shared as shared memory: a kernel asking for this much wants as many CTAs
            # per multiprocessor as fit (three of 75968 bytes on an H100, two with the default split)
            drv.check(drv.lib.cuFuncSetAttribute(self.handle, _ATTR_SHARED_CARVEOUT, 100),
                      f"cuFuncSetAttribute({self.name}, shared memory carveout 100%)")
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            values = [_CTYPES[kind]() for kind in self.signature]
            params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
            buffers = self._local.buffers = (values, params)
        values, params = buffers
        for slot, value in zip(values, args):
            slot.value = value
        drv.check(
            drv.lib.cuLaunchKernel(self.handle, grid, 1, 1, block, 1, 1, shared_bytes, ctypes.c_void_p(stream),
                                   params, None),
            f"cuLaunchKernel({self.name}, grid {grid}, block {block}, shared {shared_bytes})",
        )


class CudaModule:
    """A fatbin loaded into one device's context; kernels looked up by name (cached)."""

    def __init__(self, fatbin: Path, device: int) -> None:
        drv = driver()
        drv.ensure_context(device)
        self.device = device
        self._image = fatbin.read_bytes()  # the driver reads it during the call; keep a reference anyway
        self.handle = ctypes.c_void_p()
        drv.check(drv.lib.cuModuleLoadData(ctypes.byref(self.handle), self._image), f"cuModuleLoadData({fatbin})")
        self._kernels: dict[str, CudaKernel] = {}

    def kernel(self, name: str, signature: tuple[str, ...]) -> CudaKernel:
        found = self._kernels.get(name)
        if found is None:
            drv = driver()
            handle = ctypes.c_void_p()
            drv.check(drv.lib.cuModuleGetFunction(ctypes.byref(handle), self.handle, name.encode()),
                      f"cuModuleGetFunction({name})")
            found = self._kernels[name] = CudaKernel(handle, name, signature, self.device)
        return found


_modules: dict[tuple[Path, tuple[str, ...], int], CudaModule] = {}


def load_module(source: Path, device: torch.device, defines: tuple[str, ...] = ()) -> CudaModule:
    """``source`` built (or taken from the cache) and loaded on ``device``'s primary context."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        key = (source, defines, index)
        if key not in _modules:
            _modules[key] = CudaModule(compile_fatbin(source, defines), index)
        return _modules[key]
