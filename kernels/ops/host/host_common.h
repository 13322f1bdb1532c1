// What the host-path modules of this folder share: the CUDA driver entry points they take from the
// driver PyTorch already loaded (dlsym, so a module compiles and imports without CUDA), the checks
// every common case makes, Triton kernels kept by key and launched with cuLaunchKernel. Included by
// each <op>_<what>.cpp, which defines kHostPath (its messages' prefix) where it uses the launch and
// registration helpers; a module with a backward node includes host_autograd.h too (torch's autograd
// headers: the longer build). build.py hashes the headers of this folder into every module's cache key.

#pragma once

#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

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

// Each module's messages start with it: "<op> host path".
extern const char kHostPath[];

// Whether the driver's entry points are resolved, else false with a Python RuntimeError.
inline bool driver_or_error() {
  if (resolve_driver()) return true;
  PyErr_Format(PyExc_RuntimeError, "%s: libcuda.so.1 is not loaded or lacks cuLaunchKernel", kHostPath);
  return false;
}

// ---------------------------------------------------------------- Triton kernels and their launch

constexpr int kMaxTritonParams = 32;

// A compiled Triton kernel as kernels.launch.CachedLaunch.native_launch describes it.
struct TritonKernel {
  uint64_t function = 0;
  unsigned threads = 0;
  unsigned shared = 0;
  std::string params;  // one letter per parameter Triton's launcher passes: P pointer, i int32, l int64, f fp32
  int64_t programs = 0;  // the grid's cap where the op gives one (one wave of programs), else 0
};

// A kernel argument as Triton sees it: a pointer, an int it specializes on (left out when it is 1),
// an int it does not (do_not_specialize), an fp32.
struct Arg {
  enum Kind { kPtr, kInt, kIntKept, kF32 } kind;
  int64_t i;
  double f;
  static Arg ptr(const void* p) { return {kPtr, static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)), 0.0}; }
  static Arg ptr(uint64_t p) { return {kPtr, static_cast<int64_t>(p), 0.0}; }
  static Arg integer(int64_t v) { return {kInt, v, 0.0}; }
  static Arg kept(int64_t v) { return {kIntKept, v, 0.0}; }
  static Arg f32(double v) { return {kF32, 0, v}; }
};

// The parameter buffer of one launch: values and the pointers cuLaunchKernel reads.
struct Packed {
  union Slot {
    uint64_t u64;
    int64_t i64;
    int32_t i32;
    float f32;
  } slots[kMaxTritonParams];
  void* params[kMaxTritonParams + 2];
  uint64_t scratch = 0;
  int count = 0;
};

// Fills `out` from `args` as Triton's launcher would with these parameter letters; false if the
// letters do not fit the arguments (a kernel registered for another specialization).
inline bool pack(const std::string& letters, const Arg* args, int nargs, Packed* out) {
  size_t j = 0;
  int count = 0;
  for (int a = 0; a < nargs; ++a) {
    const Arg& arg = args[a];
    if (arg.kind == Arg::kInt && arg.i == 1) continue;  // a constexpr to Triton: not passed
    if (j >= letters.size() || count >= kMaxTritonParams) return false;
    const char letter = letters[j++];
    Packed::Slot& slot = out->slots[count];
    switch (arg.kind) {
      case Arg::kPtr:
        if (letter != 'P') return false;
        slot.u64 = static_cast<uint64_t>(arg.i);
        break;
      case Arg::kInt:
      case Arg::kIntKept:
        if (letter == 'i') {
          if (arg.i < -kInt32Max - 1 || arg.i > kInt32Max) return false;
          slot.i32 = static_cast<int32_t>(arg.i);
        } else if (letter == 'l') {
          slot.i64 = arg.i;
        } else {
          return false;
        }
        break;
      case Arg::kF32:
        if (letter != 'f') return false;
        slot.f32 = static_cast<float>(arg.f);
        break;
    }
    out->params[count] = &slot;
    ++count;
  }
  if (j != letters.size()) return false;
  out->params[count++] = &out->scratch;  // global scratch
  out->params[count++] = &out->scratch;  // profile scratch
  out->count = count;
  return true;
}

inline void launch_or_throw(const char* what, uint64_t function, unsigned grid, unsigned threads, unsigned shared,
                     void* stream, void** params) {
  const CUresult result = cu_launch_kernel(reinterpret_cast<CUfunction>(function), grid, 1, 1, threads, 1, 1,
                                           shared, reinterpret_cast<CUstream>(stream), params, nullptr);
  if (result != 0) {
    throw std::runtime_error(std::string(kHostPath) + ": cuLaunchKernel(" + what + ") failed with CUresult " +
                             std::to_string(result) + " (grid " + std::to_string(grid) + ")");
  }
}

inline void launch_triton(const char* what, const TritonKernel& kernel, unsigned grid, void* stream, const Arg* args,
                   int nargs) {
  Packed packed;
  if (!pack(kernel.params, args, nargs, &packed)) {
    throw std::runtime_error(std::string(kHostPath) + ": the registered " + what +
                             " kernel's parameters " + kernel.params + " do not fit this call");
  }
  launch_or_throw(what, kernel.function, grid, kernel.threads, kernel.shared, stream, packed.params);
}

void* current_stream(c10::DeviceIndex device) {
  const c10::Device cuda(c10::DeviceType::CUDA, device);
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(cuda).native_handle();
}

// ---------------------------------------------------------------- registries and keys

inline std::unordered_map<int, uint64_t> contexts;     // device -> the CUDA context the kernels were loaded in
inline std::unordered_map<int, uint64_t> error_words;  // device -> its error word (kernels/device_errors.py)

// The bits Triton specializes an int on: == 1, % 16 == 0, and (for the width) whether it fits int32.
inline uint64_t int_bits(int64_t v) {
  return (v == 1 ? 4u : 0u) | (v % 16 == 0 ? 2u : 0u) | (v >= -kInt32Max - 1 && v <= kInt32Max ? 1u : 0u);
}

// Rows of a fresh [R, T] fp32 allocation (aligned): row r starts 4 r T bytes in, so an odd row is
// 16-byte aligned iff T % 4 == 0, a row 2 mod 4 iff T % 2 == 0 (a row 0 mod 4 always).
inline uint64_t rows_bits(int64_t t) { return (t % 4 == 0 ? 2u : 0u) | (t % 2 == 0 ? 1u : 0u); }

// The Triton kernel described by native (handle, threads, shared, letters), or false with a Python error.
inline bool read_native(PyObject* native, TritonKernel* out) {
  unsigned long long function = 0;
  unsigned int threads = 0, shared = 0;
  const char* letters = nullptr;
  if (!PyArg_ParseTuple(native, "KIIs", &function, &threads, &shared, &letters)) return false;
  out->function = function, out->threads = threads, out->shared = shared, out->params = letters;
  return true;
}

// Stores `kernel` under `key`: 1 stored or already there, 0 the key holds another kernel.
inline int store(std::unordered_map<uint64_t, TritonKernel>& registry, uint64_t key, TritonKernel kernel) {
  const auto known = registry.find(key);
  if (known != registry.end()) {
    const TritonKernel& old = known->second;
    return old.function == kernel.function && old.threads == kernel.threads && old.shared == kernel.shared &&
           old.params == kernel.params && old.programs == kernel.programs;
  }
  registry.emplace(key, std::move(kernel));
  return 1;
}

inline bool check_fits(const char* what, const TritonKernel& kernel, const Arg* args, int nargs) {
  Packed packed;
  if (pack(kernel.params, args, nargs, &packed)) return true;
  PyErr_Format(PyExc_ValueError, "%s: the %s kernel's parameters %s do not fit its call", kHostPath, what,
               kernel.params.c_str());
  return false;
}

inline bool remember_context(int device) {
  CUcontext context = nullptr;
  if (cu_ctx_get_current(&context) != 0 || context == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "%s: no current CUDA context after a launch", kHostPath);
    return false;
  }
  const auto known = contexts.find(device);
  if (known != contexts.end() && known->second != reinterpret_cast<uint64_t>(context)) {
    PyErr_Format(PyExc_RuntimeError, "%s: device %d's CUDA context changed", kHostPath, device);
    return false;
  }
  contexts[device] = reinterpret_cast<uint64_t>(context);
  return true;
}

// Keeps `word` as `device`'s error word, or false with a Python error where it moved (it never does:
// kernels/device_errors.py allocates one per device for the process).
inline bool remember_error_word(int device, uint64_t word) {
  const auto known = error_words.find(device);
  if (known != error_words.end() && known->second != word) {
    PyErr_Format(PyExc_RuntimeError, "%s: device %d's error word moved", kHostPath, device);
    return false;
  }
  error_words[device] = word;
  return true;
}

// Whether `device`'s registered kernels may launch now: it is the current device, and the context
// they were registered in the current one; fills that context if so.
inline bool context_now(int device, uint64_t* context) {
  const auto known = contexts.find(device);
  if (known == contexts.end()) return false;
  if (c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index() != device) return false;
  CUcontext current = nullptr;
  if (cu_ctx_get_current(&current) != 0 || reinterpret_cast<uint64_t>(current) != known->second) return false;
  *context = known->second;
  return true;
}

// context_now for kernels that report bad values: fills the device's error word too.
inline bool launchable_now(int device, uint64_t* context, uint64_t* word) {
  const auto error_word = error_words.find(device);
  if (error_word == error_words.end() || !context_now(device, context)) return false;
  *word = error_word->second;
  return true;
}

// Makes `context` (the kernels') the current CUDA context if it is not (the autograd engine's device
// thread may have another one current).
inline void make_current(uint64_t context) {
  CUcontext current = nullptr;
  if (cu_ctx_get_current(&current) != 0 || reinterpret_cast<uint64_t>(current) != context) {
    if (cu_ctx_set_current(reinterpret_cast<CUcontext>(context)) != 0) {
      throw std::runtime_error(std::string(kHostPath) + ": cannot make the kernels' CUDA context current");
    }
  }
}

// ---------------------------------------------------------------- the module

// The calls a module's forward served in this process (its served()).
inline std::atomic<int64_t> served_calls{0};

inline PyObject* served(PyObject*, PyObject*) { return PyLong_FromLongLong(served_calls.load()); }

// The methods of a module with a forward and registered kernels: forward(call) (METH_O), register_forward
// and register_backward (METH_FASTCALL), clear (each forgets the module's registered kernels) and
// served, with the docstrings given.
#define HOST_PATH_METHODS(forward_doc, register_forward_doc, register_backward_doc)                    \
  {"forward", forward, METH_O, forward_doc},                                                           \
  {"register_forward", host_common::fastcall(register_forward), METH_FASTCALL, register_forward_doc},  \
  {"register_backward", host_common::fastcall(register_backward), METH_FASTCALL, register_backward_doc}, \
  {"clear", clear, METH_NOARGS, "forget every registered kernel"},                                     \
  {"served", host_common::served, METH_NOARGS, "calls the host path has served in this process"}

using FastCall = PyObject* (*)(PyObject*, PyObject* const*, Py_ssize_t);

// A METH_FASTCALL function as PyMethodDef holds it.
inline PyCFunction fastcall(FastCall function) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function));
}

// ---------------------------------------------------------------- the call object

// The tensors args[0..n) if each is a plain tensor (torch.Tensor or Parameter), else false.
inline bool plain_tensors(PyObject* const* args, int n, const at::Tensor** out) {
  for (int i = 0; i < n; ++i) {
    if (!THPVariable_CheckExact(args[i])) return false;
    out[i] = &THPVariable_Unpack(args[i]);
  }
  return true;
}

// obj.name, with the name interned once (a lookup per call, no string built).
inline PyObject* get_attr(PyObject* obj, const char* name) {
  static std::unordered_map<const char*, PyObject*> names;
  auto found = names.find(name);
  if (found == names.end()) {
    PyObject* interned = PyUnicode_InternFromString(name);
    if (interned == nullptr) return nullptr;
    found = names.emplace(name, interned).first;
  }
  return PyObject_GetAttr(obj, found->second);
}

inline bool int_attr(PyObject* call, const char* name, int64_t* out) {
  PyObject* value = get_attr(call, name);
  if (value == nullptr) return false;
  const bool ok = PyLong_CheckExact(value);
  if (ok) *out = PyLong_AsLongLong(value);
  Py_DECREF(value);
  return ok && !PyErr_Occurred();
}

// Whether the call's attribute `name` is None (false, with or without a Python error, otherwise).
inline bool attr_is_none(PyObject* obj, const char* name) {
  PyObject* value = get_attr(obj, name);
  if (value == nullptr) return false;
  Py_DECREF(value);
  return value == Py_None;
}

// The scalars of an op's checked call: temperature (a float > 0), ignore_index, and the call id its
// kernels report bad values under (`deferred`, 0 .. INT32_MAX); false if one is not as expected.
inline bool call_scalars(PyObject* obj, double* temperature, int64_t* ignore_index, int64_t* call_id) {
  PyObject* value = get_attr(obj, "temperature");
  if (value == nullptr) return false;
  const bool is_float = PyFloat_CheckExact(value);
  *temperature = is_float ? PyFloat_AS_DOUBLE(value) : 0.0;
  Py_DECREF(value);
  if (!is_float || !(*temperature > 0.0)) return false;
  if (!int_attr(obj, "ignore_index", ignore_index) || !int_attr(obj, "deferred", call_id)) return false;
  return *call_id >= 0 && *call_id <= kInt32Max;
}

}  // namespace host_common
