"""Launch a ``@triton.jit`` kernel without Triton's Python launcher on repeat calls (host time).

Small calls of our ops are launch-bound: ``kernel[grid](...)`` alone costs 15-35 us of host time
per call on our GPU hosts (binding and specializing every argument, building the cache key and
the launch metadata) before the C launcher runs. :class:`CachedLaunch` makes the first call with a
given specialization through ``kernel[grid](...)`` (which compiles or finds the kernel and returns
Triton's ``CompiledKernel``), stores that kernel under a key of its own, and on a key hit calls the
compiled kernel's C launch function directly on the current stream, as ``JITFunction.run`` would.

The key must be at least as fine as Triton's specialization, so that a hit never reuses a kernel
compiled for other arguments. It holds the current CUDA device (Triton keeps one kernel cache per
device), the Python type of every argument, and:

* a tensor: its dtype, whether ``data_ptr()`` is 16-byte aligned, and whether it is a CUDA tensor;
* an ``int``: ``== 1`` (a constexpr to Triton), ``% 16 == 0``, and its width (i32 / i64 / u64);
* a ``float`` (fp32), ``bool`` (u1) or ``None``: nothing more (Triton does not look at the value);
* a constexpr argument and a launch option (``num_warps``, ``num_stages``, ...): its value.

A hit passes tensors to the C launcher as their pointers (read once, for the key): Triton's own
check that a pointer is device memory ran on the first call, and a tensor that is not on a CUDA
device has a key of its own. Other argument types (a tensor subclass, a numpy scalar, a tuple)
take the normal launch, as do unhashable constexprs or options, a grid that is not a tuple, calls
under ``torch.compile`` tracing (dynamo knows ``kernel[grid](...)``), calls while a launch hook
is set (a profiler such as proton) or Triton's debug / instrumentation knobs are on, kernels with
pre-run hooks, and kernels that need a scratch buffer. Not repeated on a hit: Triton's check that
the global values a kernel reads did not change since it was compiled (our kernels read none).

Per argument-type pattern, the key is built by a small function generated from the kernel's
signature (as Triton's own binder is): a loop over the arguments in Python costs several us more
on our hosts.

Keyed launches (the ops' hot paths): building that key still costs ~5 us for a kernel with five
tensors, most of it reading each tensor's dtype, pointer and device. An op that knows its own
arguments better (its outputs are fresh fp32 allocations, its inputs were validated) names a key
of its own: ``direct(key)`` returns a launch function stored under it (arguments as ints, grid
1-D, no key built here), and on a miss the op calls ``launch_keyed(key, grid, *args, **kwargs)``,
which launches as above and stores the direct launch. The op's key is a promise that every call
under it binds to the same compiled kernel; ``launch_keyed`` checks the promise whenever it runs
(a key seen before with another specialization raises :class:`LaunchKeyError`), and
``RLK_VERIFY_LAUNCH_KEYS=1`` makes every call take ``launch_keyed`` (the GPU tests run the ops'
cases that way), so a key that is too coarse fails loudly instead of launching the wrong kernel.

The fast path is off (every call is ``kernel[grid](...)``) for interpreted kernels
(``TRITON_INTERPRET=1``, CPU CI: silently, that is the expected mode), with
``VIME_RL_KERNEL_FAST_LAUNCH=0`` (read once, at import), for a Triton version whose launcher was
not read for this (:data:`VERIFIED_TRITON`), and when Triton's internals are not as expected; each
such reason is logged ONCE as a warning and kept in :func:`disabled_reason`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch
import triton

from kernels import settings

logger = logging.getLogger("kernels")

# Triton versions whose JITFunction.run, CompiledKernel and CudaLauncher were read for this module:
# CudaLauncher.launch takes (grid x, y, z, stream, function, cooperative, pdl, global scratch,
# profile scratch, packed metadata, launch metadata, enter hook, exit hook, then every kernel
# argument in signature order, constexprs included; a pointer as a tensor or an int).
VERIFIED_TRITON = ("3.6.",)
ENV_SWITCH = settings.FAST_LAUNCH.name
VERIFY_SWITCH = settings.VERIFY_LAUNCH_KEYS.name
# the ranges Triton sorts an int argument by (i32, i64, u64); ops' own launch keys use them too
I32_MIN, I32_MAX, U64_MIN = -(2**31), 2**31 - 1, 2**63

# why the fast path is off in this process (None: on, or not decided yet)
_disabled: str | None = None if settings.FAST_LAUNCH.get() else f"switched off by {ENV_SWITCH}"
# every keyed call re-derives Triton's specialization and checks it against the op's key (tests)
verify_keys: bool = settings.VERIFY_LAUNCH_KEYS.get()
_runtime: _Runtime | None = None  # Triton's entry points, resolved at the first compiled launch
# under torch.compile, dynamo traces ``kernel[grid](...)`` (a user-defined Triton kernel) as before
_is_compiling: Callable[[], bool] = torch.compiler.is_compiling


class LaunchKeyError(RuntimeError):
    """An op's launch key maps calls that Triton specializes differently onto one kernel."""


def disabled_reason() -> str | None:
    """Why the fast path is off in this process, or None."""
    return _disabled


def _disable(reason: str) -> None:
    """Turn the fast path off for this process and say so, once."""
    global _disabled, _runtime
    _runtime = None
    if _disabled is None:
        _disabled = reason
        logger.warning("kernels: fast kernel launch off, every launch goes through Triton's launcher: %s", reason)


class _Runtime:
    """Triton's and torch's entry points the fast path uses, checked once (version, attributes)."""

    def __init__(self) -> None:
        version = triton.__version__
        if not version.startswith(VERIFIED_TRITON):
            raise RuntimeError(f"triton {version} is not a verified version ({', '.join(VERIFIED_TRITON)}x)")
        from triton import knobs
        from triton.knobs import HookChain
        from triton.runtime.driver import driver

        active = driver.active
        # Triton's get_current_device is torch.cuda.current_device: the lazy-init check, then this
        self.get_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", active.get_current_device)
        self.get_stream: Callable[[int], int] = active.get_current_stream
        self.runtime_knobs, self.compilation_knobs, self.hook_chain = knobs.runtime, knobs.compilation, HookChain
        self.plain()

    def plain(self) -> bool:
        """No launch hook to call (both hooks empty chains), no debug or instrumentation mode."""
        knobs, chain = self.runtime_knobs, self.hook_chain
        enter, exit_ = knobs.launch_enter_hook, knobs.launch_exit_hook
        return (
            type(enter) is chain and not enter.calls and type(exit_) is chain and not exit_.calls
            and not knobs.debug and not self.compilation_knobs.instrumentation_mode
        )


def fast_path_now() -> _Runtime | None:
    """Triton's entry points if a launch that bypasses Triton's launcher (a direct launch, an op's
    host path) may run now; None when the fast path is off or undecided, keys are being verified,
    torch.compile is tracing, or a launch hook or debug mode is on (Triton's launch must run)."""
    runtime = _runtime
    if runtime is None or verify_keys or _is_compiling() or not runtime.plain():
        return None
    return runtime


def _resolve_runtime() -> _Runtime | None:
    global _runtime
    if _runtime is None and _disabled is None:
        try:
            _runtime = _Runtime()
        except Exception as exc:  # any surprise in Triton's internals: off, loudly
            _disable(f"{type(exc).__name__}: {exc}")
    return _runtime if _disabled is None else None


def _kind(value: Any) -> str | None:
    """The argument-type class the key models, or None for a type it does not."""
    kind = type(value)
    if kind is torch.Tensor:
        return "tensor"
    if kind in (int, float, bool):
        return kind.__name__
    return "none" if value is None else None


def binder_source(params: list[tuple[str, bool]], kinds: tuple[str, ...],
                  unspecialized: frozenset[str] = frozenset()) -> str:
    """Source of ``bind(*args, **kwargs) -> (key, launch arguments) | None`` for one pattern of
    argument types; ``params``: (name, is constexpr) in signature order, ``kinds``: the ``_kind``
    of each runtime parameter, ``unspecialized``: the ints Triton does not specialize on
    (``do_not_specialize``: keyed by their width alone). It returns None when an argument's type
    is not the pattern's.
    Its own names start with ``_rlk_`` (kernel parameters may not).

    For ``k(x_ptr, n, BLOCK: tl.constexpr)`` and (tensor, int) the body is::

        if type(x_ptr) is not _rlk_Tensor or type(n) is not int:
            return None
        _rlk_p0 = x_ptr.data_ptr()
        return (_rlk_pattern, x_ptr.dtype, _rlk_p0 % 16 == 0, x_ptr.is_cuda, n == 1, n % 16 == 0,
                _rlk_I32_MIN <= n <= _rlk_I32_MAX, n >= _rlk_U64_MIN, BLOCK, *_rlk_options.items()),
                (_rlk_p0, n, BLOCK,)
    """
    checks, lines, key, args = [], [], ["_rlk_pattern"], []
    runtime = iter(kinds)
    for i, (name, constexpr) in enumerate(params):
        if name.startswith("_rlk_"):
            raise ValueError(f"kernel parameter {name!r}: names starting with _rlk_ are reserved")
        args.append(name)
        if constexpr:
            key.append(name)
            continue
        kind = next(runtime)
        if kind == "tensor":
            checks.append(f"type({name}) is not _rlk_Tensor")
            lines.append(f"_rlk_p{i} = {name}.data_ptr()")
            key += [f"{name}.dtype", f"_rlk_p{i} % 16 == 0", f"{name}.is_cuda"]
            args[-1] = f"_rlk_p{i}"
        elif kind == "none":
            checks.append(f"{name} is not None")
        else:
            checks.append(f"type({name}) is not {kind}")
            if kind == "int" and name in unspecialized:
                key += [f"_rlk_I32_MIN <= {name} <= _rlk_I32_MAX", f"{name} >= _rlk_U64_MIN"]
            elif kind == "int":
                key += [f"{name} == 1", f"{name} % 16 == 0", f"_rlk_I32_MIN <= {name} <= _rlk_I32_MAX",
                        f"{name} >= _rlk_U64_MIN"]
    signature = ", ".join(name for name, _ in params)
    body = [f"if {' or '.join(checks)}:\n        return None"] if checks else []
    body += lines
    body.append(f"return ({', '.join(key)}, *_rlk_options.items()), ({', '.join(args)},)")
    return f"def bind({signature}, **_rlk_options):\n    " + "\n    ".join(body) + "\n"


class CachedLaunch:
    """``CachedLaunch(kernel).launch(grid, *args, **kwargs)`` == ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._cache: dict[tuple, tuple] = {}
        self._binders: dict[tuple[str, ...], Callable[..., Any]] = {}
        self._bind: Callable[..., Any] = lambda *args, **kwargs: None
        self._params: list[tuple[str, bool]] = []
        self._unspecialized: frozenset[str] = frozenset()
        self._defaults: dict[str, Any] = {}
        # keyed launches: (device, op key) -> direct launch, and -> the cache key it was stored for
        self._direct: dict[tuple, Callable[..., None]] = {}
        self._direct_keys: dict[tuple, tuple] = {}
        self._native: dict[tuple, tuple[int, int, int, str] | None] = {}  # cache key -> native_launch
        self._constexpr_tail: int | None = None  # number of runtime parameters, if all constexprs trail
        from triton.runtime.jit import JITFunction

        # interpreted kernels (TRITON_INTERPRET=1) and anything that is not a plain JITFunction
        # (an autotuner, ...) always take the normal launch
        self._compiled = isinstance(kernel, JITFunction)
        if self._compiled:
            try:
                self._params = [(p.name, bool(p.is_constexpr)) for p in kernel.params]
                # ints Triton does not specialize on (``do_not_specialize``): keyed by width only
                self._unspecialized = frozenset(p.name for p in kernel.params if getattr(p, "do_not_specialize", False))
                self._defaults = {p.name: p.default for p in kernel.params if p.has_default}
                list(kernel.pre_run_hooks)
                flags = [constexpr for _, constexpr in self._params]
                runtime_count = flags.count(False)
                if not any(flags[:runtime_count]):
                    self._constexpr_tail = runtime_count
            except (AttributeError, TypeError) as exc:
                self._compiled = False
                _disable(f"{kernel}: JITFunction is not as expected ({type(exc).__name__}: {exc})")

    def bind(self, *args: Any, **kwargs: Any) -> tuple[tuple, tuple] | None:
        """(key, launch arguments) of a call, or None if it has an argument type the key does not
        model; raises TypeError for arguments that do not fit the kernel's signature."""
        bound = self._bind(*args, **kwargs)
        if bound is None:  # another pattern of argument types: its binder, generated once
            kinds = self._kinds(args, kwargs)
            if kinds is None:
                return None
            if kinds not in self._binders:
                namespace = {"_rlk_Tensor": torch.Tensor, "_rlk_pattern": kinds, "_rlk_I32_MIN": I32_MIN,
                             "_rlk_I32_MAX": I32_MAX, "_rlk_U64_MIN": U64_MIN}
                exec(binder_source(self._params, kinds, self._unspecialized), namespace)  # noqa: S102 (our own source)
                bind = namespace["bind"]
                bind.__defaults__ = self._signature_defaults()
                self._binders[kinds] = bind
            self._bind = self._binders[kinds]
            bound = self._bind(*args, **kwargs)
        return bound

    def _signature_defaults(self) -> tuple | None:
        trailing = []
        for name, _ in reversed(self._params):
            if name not in self._defaults:
                break
            trailing.append(self._defaults[name])
        return tuple(reversed(trailing)) or None

    def _kinds(self, args: tuple, kwargs: dict[str, Any]) -> tuple[str, ...] | None:
        names = [name for name, _ in self._params]
        values = dict(zip(names, args))
        values.update((k, v) for k, v in kwargs.items() if k in names)
        kinds = []
        for name, constexpr in self._params:
            if not constexpr:
                kind = _kind(values.get(name, self._defaults.get(name)))
                if kind is None:
                    return None
                kinds.append(kind)
        return tuple(kinds)

    def launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """Launch on the current device and stream, as ``kernel[grid](*args, **kwargs)`` does."""
        self._launch(grid, args, kwargs)

    def _launch(self, grid: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, tuple] | None:
        """``launch``; returns (cache key, launch arguments) when the kernel it ran is stored
        under that key (a hit, or a first call kept), else None."""
        runtime = _runtime
        if runtime is None or not self._compiled or type(grid) is not tuple or _is_compiling() or not runtime.plain():
            self._launch_normally(grid, args, kwargs, runtime)
            return None
        try:
            bound = self._bind(*args, **kwargs)  # the binder of the last pattern of argument types
            if bound is None:
                bound = self.bind(*args, **kwargs)
            device = runtime.get_device()
            key = (device, bound[0]) if bound is not None else None
            entry = self._cache.get(key) if key is not None else None
        except TypeError:  # arguments that do not fit (Triton names them), an unhashable constexpr
            key = entry = None
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and not self.kernel.pre_run_hooks and self._store(key, compiled):
                return key, bound[1]
            return None
        launch, function, cooperative, pdl, packed_metadata = entry
        size = len(grid)
        launch(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, runtime.get_stream(device),
               function, cooperative, pdl, None, None, packed_metadata, None, None, None, *bound[1])
        return key, bound[1]

    def launch_native(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> tuple[int, int, int, str] | None:
        """``launch(grid, *args, **kwargs)``; returns :meth:`native_launch` of the kernel it ran
        (None where it kept none: a normal launch, hooks, tracing, ...), for an op that registers
        its kernels with a host path in C++ (kernels/ops/host/)."""
        ran = self._launch(grid, args, kwargs)
        return None if ran is None else self._native.get(ran[0])

    def direct(self, key: Hashable) -> Callable[..., None] | None:
        """The launch stored by ``launch_keyed`` under the op's ``key`` for the current device, if
        the fast path may run now (else None: call ``launch_keyed``). It is called as
        ``direct(grid_x, *runtime arguments)``: a 1-D grid, the kernel's non-constexpr arguments
        in signature order with tensors as ``data_ptr()`` ints; the constexprs and options are the
        stored call's."""
        runtime = fast_path_now()
        return None if runtime is None else self._direct.get((runtime.get_device(), key))

    def launch_keyed(self, key: Hashable, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> tuple | None:
        """``launch(grid, *args, **kwargs)``, and keep a direct launch of the kernel it ran under
        ``key`` (the op's promise: every call under ``key`` binds to this specialization; checked
        here, :class:`LaunchKeyError` if a call under ``key`` bound to another one). Returns the
        cache key of the kernel it ran (for :meth:`native_launch`), or None if it kept nothing."""
        ran = self._launch(grid, args, kwargs)
        if ran is None:  # a normal launch that keeps nothing (hooks, tracing, unmodelled types, ...)
            return None
        cache_key, launch_args = ran
        direct_key = (cache_key[0], key)
        known = self._direct_keys.get(direct_key)
        if known is not None:
            if known != cache_key:
                raise LaunchKeyError(
                    f"{self.kernel}: the op's launch key {key!r} was stored for Triton's specialization "
                    f"{known[1]!r}, and this call binds to {cache_key[1]!r}; the op's key must tell them apart"
                )
            return cache_key
        if self._constexpr_tail is None or len(grid) != 1:
            return cache_key  # direct launches need trailing constexprs and a 1-D grid: keyed calls stay generic
        tail = launch_args[self._constexpr_tail:]  # the constexprs' values, appended to every direct call
        launch, function, cooperative, pdl, packed_metadata = self._cache[cache_key]
        get_stream, device = _runtime.get_stream, cache_key[0]

        def direct(grid_x: int, *args: Any) -> None:
            launch(grid_x, 1, 1, get_stream(device), function, cooperative, pdl, None, None, packed_metadata,
                   None, None, None, *args, *tail)

        self._direct_keys[direct_key] = cache_key
        self._direct[direct_key] = direct
        return cache_key

    def native_launch(self, cache_key: tuple) -> tuple[int, int, int, str] | None:
        """How to launch the kernel stored under ``cache_key`` with ``cuLaunchKernel`` (a host
        path in C++, kernels/ops/host/): ``(CUfunction handle, threads per block, dynamic shared
        memory bytes, its runtime parameters)``, one letter per parameter Triton's launcher passes
        before the two scratch pointers (``P`` pointer, ``i`` int32, ``l`` int64, ``f`` fp32;
        constexprs, ints specialized to 1 included, are not passed). None if a plain launch does
        not reproduce Triton's (a cooperative grid, PDL, a cluster of CTAs) or a parameter has
        another type."""
        return self._native.get(cache_key)

    def _launch_normally(self, grid: Any, args: tuple, kwargs: dict[str, Any], runtime: _Runtime | None) -> None:
        self.kernel[grid](*args, **kwargs)
        if runtime is None and self._compiled:
            _resolve_runtime()  # the first compiled launch in this process: check Triton once

    def _store(self, key: tuple, compiled: Any) -> bool:
        """Keep what the normal launch compiled (and just launched, so its handles are loaded);
        whether it was kept."""
        if compiled is None or hasattr(compiled, "result"):  # skipped by a jit hook, or still compiling
            return False
        try:
            launcher, function, packed_metadata = compiled.run, compiled.function, compiled.packed_metadata
            launch, cooperative, pdl = launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl
            scratch = launcher.global_scratch_size, launcher.profile_scratch_size
        except AttributeError as exc:
            _disable(f"Triton's compiled kernel or its launcher has no attribute {exc.name!r}")
            return False
        if not callable(launch) or function is None:
            _disable(f"Triton's compiled kernel is not loaded after a launch ({launch=}, {function=})")
            return False
        if any(scratch):  # the launcher allocates scratch per call: keep Triton's launcher
            return False
        self._cache[key] = (launch, function, cooperative, pdl, packed_metadata)
        self._native[key] = _native_launch(compiled, function, cooperative, pdl, packed_metadata)
        return True


# a runtime parameter's type in Triton's signature -> its letter in native_launch's parameters
_NATIVE_PARAMS = {"i32": "i", "i64": "l", "fp32": "f"}


def _native_launch(compiled: Any, function: int, cooperative: Any, pdl: Any,
                   packed_metadata: Any) -> tuple[int, int, int, str] | None:
    """``native_launch``'s tuple for a compiled kernel (packed metadata, Triton 3.6: num_warps,
    num_ctas, shared memory bytes), or None."""
    try:
        signature = dict(compiled.src.signature)
        num_warps, num_ctas, shared = packed_metadata
    except (AttributeError, TypeError, ValueError):
        return None
    if cooperative or pdl or num_ctas != 1:
        return None
    params = []
    for kind in signature.values():
        if kind == "constexpr":
            continue
        letter = "P" if isinstance(kind, str) and kind.startswith("*") else _NATIVE_PARAMS.get(kind)
        if letter is None:
            return None
        params.append(letter)
    return int(function), 32 * int(num_warps), int(shared), "".join(params)
