"""kernels.launch's cache key against Triton's own argument specialization: equal keys mean equal
specialization, the key separates what Triton separates (dtype, 16-byte alignment, device,
constexprs and options by value), launch arguments in signature order, unmodelled argument types
not keyed, reserved parameter names refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import launch
from suites.op.launch.stand_ins import jit


def _one_arg_fn(x):
    """Signature stand-in: one runtime parameter."""


# ---------------------------------------------------------------- the key vs Triton's specialization


def _triton_specialization(value):
    native = pytest.importorskip("triton._C.libtriton", reason="triton's native specializer is needed")
    try:
        from triton.backends.nvidia.compiler import CUDABackend as backend
    except ImportError:
        from triton.backends.compiler import BaseBackend as backend
    return native.native_specialize_impl(backend, value, False, True, True)


def _sample_values():
    base = torch.empty(64, dtype=torch.float32)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -100, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1,
            -(2**31) - 16, 2**40, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
    tensors = [base, base[1:], base[4:], base[8:], torch.empty(8, dtype=torch.bfloat16), torch.empty(8)[3:],
               torch.empty(8, dtype=torch.int64), torch.empty(9, dtype=torch.int32)[1:],
               torch.empty(4, dtype=torch.bool),
               torch.empty(8, dtype=torch.float16)[1:]]
    return ints + [0.5, 1.0, 2.0, -3.25, True, False, None] + tensors


def _key(fast, *args, **kwargs):
    bound = fast.bind(*args, **kwargs)
    assert bound is not None
    return bound[0]


def test_equal_keys_mean_equal_triton_specialization():
    """Soundness: two arguments with one key never get two specializations from Triton."""
    fast = jit(_one_arg_fn)
    seen: dict[object, tuple] = {}
    for value in _sample_values():
        spec = _triton_specialization(value)
        key = _key(fast, value)
        assert seen.setdefault(key, spec) == spec, f"{value!r}: key {key!r} covers {seen[key]} and {spec}"
    assert len(seen) >= 12  # the samples do exercise many classes


@pytest.mark.parametrize(("a", "b"), [
    (16, 17), (1, 2), (1, 17), (2**31 - 1, 2**31), (-(2**31), -(2**31) - 1), (2**63 - 16, 2**63), (1.0, 1), (True, 1),
    (None, 0),
])
def test_key_separates_what_triton_separates(a, b):
    fast = jit(_one_arg_fn)
    assert _key(fast, a) != _key(fast, b)


def test_key_of_tensors_is_dtype_16_byte_alignment_and_device():
    fast = jit(_one_arg_fn)
    base = torch.empty(64, dtype=torch.float32)
    assert _key(fast, base) == _key(fast, base[4:])
    assert _key(fast, base[1:]) == _key(fast, base[2:]) != _key(fast, base)
    assert _key(fast, base) != _key(fast, base.to(torch.bfloat16))
    assert _key(fast, 16) == _key(fast, 4096) and _key(fast, 3) == _key(fast, 1031)  # no key per value
    if torch.cuda.is_available():
        assert _key(fast, base) != _key(fast, base.cuda())


def test_launch_arguments_are_pointers_and_values_in_signature_order():
    fast = jit()
    x, y = torch.empty(8), torch.empty(8, dtype=torch.int32)
    key, args = fast.bind(x, y, 8, 0.5, True, BLOCK=128, MODE=2, num_warps=4)
    assert args == (x.data_ptr(), y.data_ptr(), 8, 0.5, True, 128, 2)
    assert key[-1] == ("num_warps", 4)  # launch options are keyed, not kernel arguments
    assert fast.bind(x, y, n=8, scale=0.5, flag=True, MODE=2, BLOCK=128)[1] == args


@pytest.mark.parametrize("value", [np.int64(3), np.float32(1.0), "text", torch.float32, (1, 2),
                                   torch.nn.Parameter(torch.empty(2))])
def test_unmodelled_argument_types_are_not_keyed(value):
    assert jit(_one_arg_fn).bind(value) is None


def test_call_key_has_constexprs_and_options_by_value():
    fast = jit()
    x = torch.empty(8)
    key = _key(fast, x, x, 8, 1.0, True, BLOCK=128, MODE=0, num_warps=4)
    assert key == _key(fast, x, x, 24, 2.0, False, BLOCK=128, MODE=0, num_warps=4)
    for change in ({"BLOCK": 256}, {"MODE": 1}, {"num_warps": 8}, {"num_stages": 2}):
        assert key != _key(fast, x, x, 8, 1.0, True, **{"BLOCK": 128, "MODE": 0, "num_warps": 4, **change})
    # a constexpr passed positionally is keyed by value; a runtime argument by keyword by its class
    assert _key(fast, x, x, 8, 1.0, True, 128, MODE=0) != _key(fast, x, x, 8, 1.0, True, 256, MODE=0)
    assert _key(fast, x, x, n=8, scale=1.0, flag=True, BLOCK=128, MODE=0) == _key(
        fast, x, x, n=24, scale=2.0, flag=False, BLOCK=128, MODE=0)
    with pytest.raises(TypeError):
        fast.bind(x, x, 8, 1.0, True, 128, 0, 99)


def test_patterns_of_argument_types_get_their_own_binder():
    fast = jit()
    x = torch.empty(8)
    with_tensor = _key(fast, x, x, 8, 1.0, True, BLOCK=128, MODE=0)
    with_none = _key(fast, x, None, 8, 1.0, True, BLOCK=128, MODE=0)
    assert with_tensor != with_none and len(fast._binders) == 2
    assert _key(fast, x, x, 8, 1.0, True, BLOCK=128, MODE=0) == with_tensor and len(fast._binders) == 2


def test_reserved_parameter_names_are_refused():
    with pytest.raises(ValueError, match="reserved"):
        launch.binder_source([("_rlk_x", False)], ("int",))
