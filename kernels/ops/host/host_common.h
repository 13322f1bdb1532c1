// What the host-path modules of this folder share: the CUDA driver entry points they take from the
// driver PyTorch already loaded (dlsym, so a module compiles and imports without CUDA), and the
// checks every common case makes. Included by each <op>_<what>.cpp; build.py hashes the headers
// of this folder into every module's cache key.

#pragma once

#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/ScalarType.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <dlfcn.h>

#include <cstdint>

namespace host_common {

using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using CUcontext = void*;
using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, CUstream, void**, void**);
using CtxGetCurrentFn = CUresult (*)(CUcontext*);
using CtxSetCurrentFn = CUresult (*)(CUcontext);

inline LaunchKernelFn cu_launch_kernel = nullptr;
inline CtxGetCurrentFn cu_ctx_get_current = nullptr;
inline CtxSetCurrentFn cu_ctx_set_current = nullptr;

constexpr int64_t kInt32Max = 2147483647;

// Whether the driver's entry points are resolved (now, on the first call): PyTorch loaded the driver
// when it initialized CUDA, so this takes its symbols and loads nothing.
inline bool resolve_driver() {
  if (cu_launch_kernel != nullptr) return true;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return false;
  cu_ctx_get_current = reinterpret_cast<CtxGetCurrentFn>(dlsym(lib, "cuCtxGetCurrent"));
  cu_ctx_set_current = reinterpret_cast<CtxSetCurrentFn>(dlsym(lib, "cuCtxSetCurrent"));
  cu_launch_kernel = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
  return cu_launch_kernel != nullptr && cu_ctx_get_current != nullptr && cu_ctx_set_current != nullptr;
}

// No torch function mode and no dispatch mode active: a Python-level override would not see a call
// the host path served.
inline bool no_python_modes() {
  return !at::impl::torch_function_mode_enabled() && c10::impl::TorchDispatchModeTLS::stack_len() == 0;
}

// Whether a METH_FASTCALL function got `want` arguments (else a TypeError naming `name` is set).
inline bool takes(const char* name, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, nargs);
  return false;
}

// A dtype's code in the modules' launch keys: 0..4 fp32, bf16, fp16, fp64, bool; 5 int64, 6 int32;
// -1 for any other (never the common case).
inline int dtype_code(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return 0;
    case c10::ScalarType::BFloat16: return 1;
    case c10::ScalarType::Half: return 2;
    case c10::ScalarType::Double: return 3;
    case c10::ScalarType::Bool: return 4;
    case c10::ScalarType::Long: return 5;
    case c10::ScalarType::Int: return 6;
    default: return -1;
  }
}

inline bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace host_common
