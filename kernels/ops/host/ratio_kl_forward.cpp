// ratio_kl's no-grad forward on its host fast path: one C++ call that accepts the common case,
// allocates the two outputs and launches the Triton kernel the Python path compiled for it.
//
// Why: a ratio_kl call of T <= 64 tokens is all host time. In Python it reads ~25 tensor
// attributes to check and key four inputs (~5 us on our GPU hosts), two torch.empty_like and
// Triton's launcher; here the checks are a few field reads, and the launch is one cuLaunchKernel.
//
// The contract with kernels/ops/ratio_kl.py (which builds this file with kernels/ops/host/build.py):
// * forward(logp, old_logp, ref_logp, mask, kl_code, unbiased, device, stream) returns
//   (ratio, kl), or None when the call is not the common case or its kernel is not registered
//   yet. It never raises for bad input: the Python path runs then, and its checks name the
//   problem. The common case: four plain tensors (torch.Tensor or Parameter), 1-D, contiguous,
//   the same length T (0 < T <= INT32_MAX) on CUDA device `device` (the current one); logp fp32
//   and not needing a gradient; old/ref fp32|bf16|fp16|fp64; mask bool or one of those; no
//   torch function or dispatch mode active; a current CUDA context.
// * register(logp, old_logp, ref_logp, mask, kl_code, unbiased, device, function, block, threads,
//   shared, params) stores the compiled Triton kernel (CUfunction handle, tokens per program,
//   threads per block, dynamic shared memory, its runtime parameters as a string of 'P' pointer /
//   'i' int32) that the Python path just launched for these inputs, under this call's key (the
//   BLOCK constexpr is not in the key: ratio_kl.py fixes it, and a change is caught here, as a
//   kernel that differs under one key). The key holds
//   everything Triton specializes this kernel on: the device, the three input dtypes that vary,
//   each input's 16-byte alignment, T == 1 and T % 16 == 0, the KL type and the unbiased flag (the
//   outputs are fresh fp32 allocations: aligned). It returns False, storing nothing, if the key
//   already holds another kernel (the key would be too coarse: Python raises LaunchKeyError).
// * clear() forgets every registered kernel.
//
// The kernel's parameters, as Triton 3.6's launcher passes them: logp, old, ref, mask, ratio,
// kl pointers, then n (absent when T == 1: Triton makes it a constexpr), then the global and
// profile scratch pointers (null: kernels that need scratch are never registered).

#include <Python.h>

#include <ATen/ops/empty_like.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <string>
#include <unordered_map>

#include "host_common.h"

namespace {

using namespace host_common;

constexpr int kMaxParams = 7;  // the kernel's runtime parameters: 6 pointers and n

struct Kernel {
  uint64_t function;
  int64_t block;  // tokens per program (the kernel's BLOCK): the grid is ceil(T / block)
  unsigned threads;
  unsigned shared;
  std::string params;
};

std::unordered_map<uint64_t, Kernel> kernels;

struct Call {
  const at::Tensor* tensors[4];
  int64_t n;
  uint64_t key;
};

// Whether args[0..7] are a common-case call (see the contract above); fills `call` if so.
bool common_case(PyObject* const* args, Call* call) {
  for (int i = 0; i < 4; ++i) {
    if (!THPVariable_CheckExact(args[i])) return false;
    call->tensors[i] = &THPVariable_Unpack(args[i]);
  }
  const at::Tensor& logp = *call->tensors[0];
  if (logp.dim() != 1 || logp.scalar_type() != at::kFloat || !logp.is_cuda() || !logp.is_contiguous()) return false;
  if (logp.requires_grad() && c10::GradMode::is_enabled()) return false;
  const int64_t n = logp.size(0);
  if (n <= 0 || n > kInt32Max) return false;
  const long device = PyLong_AsLong(args[6]);
  if (device < 0 || device > 255 || logp.get_device() != device) return false;
  const long kl_code = PyLong_AsLong(args[4]);
  if (kl_code < 0 || kl_code > 3 || (args[5] != Py_True && args[5] != Py_False)) return false;
  uint64_t key = static_cast<uint64_t>(device);
  for (int i = 1; i < 4; ++i) {
    const at::Tensor& t = *call->tensors[i];
    if (t.dim() != 1 || t.size(0) != n || !t.is_cuda() || t.get_device() != device || !t.is_contiguous()) return false;
    const int code = dtype_code(t.scalar_type());
    if (code < 0 || code > 4 || (code == 4 && i != 3)) return false;  // floating, or a bool mask
    key = key << 3 | static_cast<uint64_t>(code);
  }
  for (int i = 0; i < 4; ++i) key = key << 1 | (aligned(call->tensors[i]->data_ptr()) ? 1u : 0u);
  key = key << 1 | (n == 1 ? 1u : 0u);
  key = key << 1 | (n % 16 == 0 ? 1u : 0u);
  key = key << 2 | static_cast<uint64_t>(kl_code);
  key = key << 1 | (args[5] == Py_True ? 1u : 0u);
  call->n = n;
  call->key = key;
  return true;
}

PyObject* forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes("forward", nargs, 8)) return nullptr;
  Call call;
  if (kernels.empty() || !common_case(args, &call)) {
    PyErr_Clear();  // an int conversion that failed is just "not the common case"
    Py_RETURN_NONE;
  }
  const auto found = kernels.find(call.key);
  if (found == kernels.end() || !no_python_modes()) Py_RETURN_NONE;
  CUcontext context = nullptr;
  if (cu_ctx_get_current(&context) != 0 || context == nullptr) Py_RETURN_NONE;  // Triton sets one up
  const uint64_t stream = PyLong_AsUnsignedLongLong(args[7]);
  if (PyErr_Occurred()) return nullptr;
  const Kernel& kernel = found->second;
  try {
    at::Tensor ratio = at::empty_like(*call.tensors[0]);
    at::Tensor kl = at::empty_like(*call.tensors[0]);
    uint64_t pointers[6];
    for (int i = 0; i < 4; ++i) pointers[i] = reinterpret_cast<uintptr_t>(call.tensors[i]->data_ptr());
    pointers[4] = reinterpret_cast<uintptr_t>(ratio.data_ptr());
    pointers[5] = reinterpret_cast<uintptr_t>(kl.data_ptr());
    int32_t n = static_cast<int32_t>(call.n);
    uint64_t scratch = 0;
    void* params[kMaxParams + 2];
    int count = 0, pointer = 0;
    for (const char kind : kernel.params) params[count++] = kind == 'P' ? static_cast<void*>(&pointers[pointer++])
                                                                        : static_cast<void*>(&n);
    params[count++] = &scratch;  // global scratch
    params[count++] = &scratch;  // profile scratch
    const unsigned grid = static_cast<unsigned>((call.n + kernel.block - 1) / kernel.block);
    const CUresult result = cu_launch_kernel(reinterpret_cast<CUfunction>(kernel.function), grid, 1, 1,
                                             kernel.threads, 1, 1, kernel.shared,
                                             reinterpret_cast<CUstream>(stream), params, nullptr);
    if (result != 0) {
      PyErr_Format(PyExc_RuntimeError, "ratio_kl host path: cuLaunchKernel failed with CUresult %d (grid %u)",
                   result, grid);
      return nullptr;
    }
    PyObject* out = PyTuple_New(2);
    if (out == nullptr) return nullptr;
    PyTuple_SET_ITEM(out, 0, THPVariable_Wrap(std::move(ratio)));
    PyTuple_SET_ITEM(out, 1, THPVariable_Wrap(std::move(kl)));
    return out;
  } catch (const std::exception& exc) {  // an allocation that failed (out of memory), ...
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
}

PyObject* register_kernel(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes("register", nargs, 12)) return nullptr;
  Call call;
  if (!common_case(args, &call)) {
    if (PyErr_Occurred()) PyErr_Clear();
    Py_RETURN_NONE;  // not a call the fast path serves: nothing to store
  }
  if (!resolve_driver()) {
    PyErr_SetString(PyExc_RuntimeError, "ratio_kl host path: libcuda.so.1 is not loaded or lacks cuLaunchKernel");
    return nullptr;
  }
  Kernel kernel;
  kernel.function = PyLong_AsUnsignedLongLong(args[7]);
  kernel.block = PyLong_AsLongLong(args[8]);
  kernel.threads = static_cast<unsigned>(PyLong_AsUnsignedLong(args[9]));
  kernel.shared = static_cast<unsigned>(PyLong_AsUnsignedLong(args[10]));
  if (PyErr_Occurred()) return nullptr;
  if (kernel.block <= 0) {
    PyErr_Format(PyExc_ValueError, "ratio_kl host path: block must be > 0, got %lld",
                 static_cast<long long>(kernel.block));
    return nullptr;
  }
  const char* params = PyUnicode_AsUTF8(args[11]);
  if (params == nullptr) return nullptr;
  kernel.params = params;
  int pointer_params = 0;
  for (const char kind : kernel.params) {
    if (kind == 'P') {
      ++pointer_params;
    } else if (kind != 'i') {
      PyErr_Format(PyExc_ValueError, "ratio_kl host path: unsupported kernel parameters %s", params);
      return nullptr;
    }
  }
  if (pointer_params != 6 || kernel.params.size() != (call.n == 1 ? 6u : 7u)) {
    PyErr_Format(PyExc_ValueError, "ratio_kl host path: kernel parameters %s do not fit T = %lld", params,
                 static_cast<long long>(call.n));
    return nullptr;
  }
  const auto known = kernels.find(call.key);
  if (known != kernels.end()) {
    const Kernel& old = known->second;
    if (old.function != kernel.function || old.block != kernel.block || old.threads != kernel.threads ||
        old.shared != kernel.shared || old.params != kernel.params) {
      Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
  }
  kernels.emplace(call.key, std::move(kernel));
  Py_RETURN_TRUE;
}

PyObject* clear(PyObject*, PyObject*) {
  kernels.clear();
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forward)), METH_FASTCALL,
     "forward(logp, old_logp, ref_logp, mask, kl_code, unbiased, device, stream) -> (ratio, kl) | None"},
    {"register", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(register_kernel)), METH_FASTCALL,
     "register(logp, old_logp, ref_logp, mask, kl_code, unbiased, device, function, block, threads, shared, params)"
     " -> True (stored or already there) | False (the key holds another kernel) | None (not a common case)"},
    {"clear", clear, METH_NOARGS, "forget every registered kernel"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "ratio_kl_forward", "ratio_kl's host fast path", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_ratio_kl_forward(void) { return PyModule_Create(&module); }
