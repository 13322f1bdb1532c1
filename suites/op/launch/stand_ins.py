"""Stand-ins for Triton's launch machinery (a launcher recording its calls, a compiled kernel,
``kernel[grid]``, the runtime), for the tests of kernels.launch; conftest.py's ``stand_ins`` installs
them."""

from __future__ import annotations

import triton.language as tl
from triton.runtime.jit import JITFunction

from kernels.launch import CachedLaunch


def kernel_fn(x_ptr, y_ptr, n, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr):
    """Signature stand-in for a kernel (never compiled): 5 runtime params, 2 constexprs."""


def jit(fn=kernel_fn) -> CachedLaunch:
    # a JITFunction whatever TRITON_INTERPRET says (triton.jit would give an InterpretedFunction)
    return CachedLaunch(JITFunction(fn))


class Launcher:
    """Stands in for Triton's CudaLauncher: records calls of its C launch function."""

    def __init__(self):
        self.launches, self.launch_cooperative_grid, self.launch_pdl = [], False, False
        self.global_scratch_size = self.profile_scratch_size = 0

    def launch(self, *args):
        self.launches.append(args)


class Compiled:
    """Stands in for Triton's CompiledKernel."""

    def __init__(self):
        self.function, self.packed_metadata, self.run = 0xF00, (4, 1, 0), Launcher()


class Normal:
    """Stands in for ``kernel[grid](...)``: records calls and returns a fresh compiled kernel."""

    pre_run_hooks: list = []

    def __init__(self, compiled_type=Compiled):
        self.calls, self.compiled, self.compiled_type = [], [], compiled_type

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            self.compiled.append(self.compiled_type())
            return self.compiled[-1]
        return call


class Runtime:
    def __init__(self):
        self.device, self.stream, self.hooked = 0, 0xABC, False

    def get_device(self):
        return self.device

    def get_stream(self, device):
        return self.stream + device

    def plain(self):
        return not self.hooked
