// logp's single-device forward and its backward on the host fast path: one C++ call that accepts the
// common case, allocates the output (and the row statistics where a gradient is wanted), launches the
// forward kernel and, where a gradient is wanted, attaches a C++ autograd node whose backward launches
// the backward kernel. Neither the forward nor the backward enters Python.
//
// Why: a launch-bound logp call is all host time, and most of it is Python: autograd.Function's apply
// and its backward (each a Python frame the engine calls), reading tensor attributes to key the
// launches, an allocation each way. Here the checks are field reads, each launch is one
// cuLaunchKernel, and the backward is a torch::autograd::Node (the engine calls it without the GIL).
//
// The contract with kernels/ops/logp.py (which builds this file with kernels/ops/host/build.py):
// * forward(call) returns the log-prob (fp32 [T]) as logp_call does, or None when the call is not the
//   common case or a kernel it needs is not registered yet. It never raises for bad input: the Python
//   path runs then, and its checks name the problem. The common case (beyond what the contract,
//   LogpCall, has checked): no tp_group; logits a plain tensor [T, V] (T, V < 2**31)
//   fp32|bf16|fp16, contiguous with row stride V, 16-byte aligned, on the current CUDA device;
//   target_ids a plain int64 tensor [T], contiguous, on that device; no torch function or dispatch
//   mode active; the current
//   CUDA context the one the kernels were registered in. A call that wants a gradient (logits
//   requiring one, grad mode on) needs the forward kernel that stores the row statistics and the
//   backward kernel registered; a call that does not, the forward kernel that stores the log-prob only.
// * register_forward(logits, ids, row_max, sumexp, temperature, ignore_index, stats, native,
//   error_word) stores the forward kernel the Python path just launched for these inputs
//   (kernels.launch.CachedLaunch.native_launch's tuple: CUfunction handle, threads per block, dynamic
//   shared memory, parameter letters); row_max and sumexp are the statistics rows it wrote (the output
//   itself where stats is False). register_backward(logits, ids, grad_output, row_max, sumexp,
//   temperature, ignore_index, native) stores the backward kernel. Each kernel is kept under a key
//   that holds everything Triton specializes it on (kernel_key); a register call returns None
//   (storing nothing) where the inputs are not the common case's, False where the key already holds
//   another kernel (the key would be too coarse: Python raises LaunchKeyError), else True.
// * clear() forgets every registered kernel; served() counts the calls forward served.
//
// Semantics kept from LogpFunction and logp_call: the ids range checked by the forward kernel, which
// makes a bad row NaN and reports it under the call's id (`deferred`) in the device's error word
// (kernels/device_errors.py); logits and ids saved as SavedVariables (saved-tensor hooks, the
// version-counter check, "backward through the graph a second time" after release); a backward
// through a retained graph recomputes from the saved statistics, as often as it is called; an
// undefined gradient counts as zeros; the forward's launch on the current stream, the backward's on
// the stream the engine makes current (the forward's), so CUDA-graph capture records both.
//
// The kernels' parameters, as Triton 3.6's launcher passes them (see host_common.h's pack):
// forward: logits, ids, out, row_max, sumexp, error word; stride, vocab, vocab_start (0), id_bound
// (V), ignore_index, temperature, call id (not specialized); backward: logits, dlogits, ids,
// grad_output, row_max, sumexp; stride, dlogits stride, vocab, vocab_start (0), ignore_index,
// temperature.

#include <Python.h>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <cstdint>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "host_autograd.h"
#include "host_common.h"

const char host_common::kHostPath[] = "logp host path";

namespace {

using namespace host_common;

constexpr int kForwardArgs = 13;
constexpr int kBackwardArgs = 12;

std::unordered_map<uint64_t, TritonKernel> forward_kernels, backward_kernels;

// Whether logits [T, V] and ids [T] are the common case's (see the contract above).
bool inputs_fit(const at::Tensor& logits, const at::Tensor& ids) {
  const int code = dtype_code(logits.scalar_type());
  if (logits.dim() != 2 || !logits.is_cuda() || code < 0 || code > 2 || !logits.is_contiguous() ||
      !aligned(logits.data_ptr())) {
    return false;
  }
  const int64_t t = logits.size(0), v = logits.size(1);
  // the row stride too: a [1, V] tensor is contiguous whatever its stride(0), which Triton sees
  if (t <= 0 || v <= 0 || t > kInt32Max || v > kInt32Max || logits.stride(0) != v) return false;
  return ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.size(0) == t && ids.is_cuda() &&
         ids.get_device() == logits.get_device() && ids.is_contiguous();
}

// What Triton specializes both kernels on, given inputs that fit: V exactly (stride, vocab and
// id_bound; the vocab block and warps follow from it), the logits' dtype, the ids' alignment, the
// statistics rows' alignment (fresh [3, T] fp32: rows 1 and 2; the output itself without
// statistics), ignore_index as Triton sees an int, SCALE (temperature != 1). The logits are aligned,
// the outputs fresh (aligned), the error word fixed per device, vocab_start 0, the call id not
// specialized on; the backward's grad_output is made an aligned fp32 [T].
uint64_t kernel_key(int device, const at::Tensor& logits, const at::Tensor& ids, int64_t ignore_index,
                    double temperature, bool stats) {
  uint64_t key = static_cast<uint64_t>(device);
  key = key << 2 | static_cast<uint64_t>(dtype_code(logits.scalar_type()));
  key = key << 31 | static_cast<uint64_t>(logits.size(1));
  key = key << 1 | (aligned(ids.data_ptr()) ? 1u : 0u);
  key = key << 2 | (stats ? rows_bits(logits.size(0)) : 0u);
  key = key << 3 | int_bits(ignore_index);
  key = key << 1 | (temperature != 1.0 ? 1u : 0u);
  key = key << 1 | (stats ? 1u : 0u);
  return key;
}

// Whether row_max and sumexp are where kernel_key assumes them: rows 1 and 2 of a fresh [3, T]
// buffer (stats), or the aligned output itself.
bool rows_fit(const at::Tensor& row_max, const at::Tensor& sumexp, int64_t t, bool stats) {
  const uint64_t bits = (aligned(row_max.data_ptr()) ? 2u : 0u) | (aligned(sumexp.data_ptr()) ? 1u : 0u);
  return bits == (stats ? rows_bits(t) : 3u);
}

void launch_forward(const TritonKernel& kernel, const at::Tensor& logits, const at::Tensor& ids, char* out,
                    bool stats, uint64_t word, double temperature, int64_t ignore_index, int64_t call_id,
                    void* stream) {
  const int64_t t = logits.size(0), v = logits.size(1);
  char* row_max = stats ? out + 4 * t : out;
  char* sumexp = stats ? out + 8 * t : out;
  const Arg args[kForwardArgs] = {
      Arg::ptr(logits.data_ptr()), Arg::ptr(ids.data_ptr()), Arg::ptr(out), Arg::ptr(row_max), Arg::ptr(sumexp),
      Arg::ptr(word), Arg::integer(v), Arg::integer(v), Arg::integer(0), Arg::integer(v), Arg::integer(ignore_index),
      Arg::f32(temperature), Arg::kept(call_id)};
  launch_triton("forward", kernel, static_cast<unsigned>(t), stream, args, kForwardArgs);
}

// ---------------------------------------------------------------- the backward node

// kernel_: the backward kernel
struct LogpBackward : public LogitsBackward {
  at::Tensor stats_;  // [3, T] fp32: the log-prob, the row max, the sum of exp(z - max)

  std::string name() const override { return "LogpBackward"; }

  void release_variables() override {
    LogitsBackward::release_variables();
    stats_.reset();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    // raises if released (a second backward without retain_graph) or modified in place
    at::Tensor logits = logits_.unpack();
    at::Tensor ids = ids_.unpack();
    if (!logits.is_cuda() || logits.get_device() != device_ || !ids.is_cuda() || ids.get_device() != device_) {
      throw std::runtime_error(std::string(kHostPath) + ": the saved logits or ids are not on cuda:" +
                               std::to_string(device_) + " any more (a saved-tensor hook moved them)");
    }
    logits = fitting(logits, logits.scalar_type());
    ids = fitting(ids, at::kLong);
    const int64_t t = logits.size(0), v = logits.size(1);
    const at::Tensor g = grads[0].defined() ? fitting(grads[0], at::kFloat)
                                            : at::zeros({t}, logits.options().dtype(at::kFloat));
    make_current(context_);
    at::Tensor grad = at::empty({t, v}, logits.options());
    const char* rows = static_cast<const char*>(stats_.data_ptr());
    const Arg args[kBackwardArgs] = {
        Arg::ptr(logits.data_ptr()), Arg::ptr(grad.data_ptr()), Arg::ptr(ids.data_ptr()), Arg::ptr(g.data_ptr()),
        Arg::ptr(rows + 4 * t), Arg::ptr(rows + 8 * t), Arg::integer(v), Arg::integer(v), Arg::integer(v),
        Arg::integer(0), Arg::integer(ignore_index_), Arg::f32(temperature_)};
    launch_triton("backward", kernel_, static_cast<unsigned>(t), current_stream(static_cast<c10::DeviceIndex>(device_)),
                  args, kBackwardArgs);
    return {grad};
  }
};

// ---------------------------------------------------------------- the call's common case

struct Call {
  const at::Tensor* logits = nullptr;
  const at::Tensor* ids = nullptr;
  int device = 0;
  double temperature = 1.0;
  int64_t ignore_index = 0, call_id = 0;
  PyObject* held[2] = {nullptr, nullptr};  // the attributes the tensor pointers above point into
  ~Call() {
    Py_XDECREF(held[0]);
    Py_XDECREF(held[1]);
  }
};

// The call's attribute `name` as a plain tensor, or false.
bool tensor_attr(PyObject* obj, const char* name, PyObject** held, const at::Tensor** tensor) {
  *held = get_attr(obj, name);
  if (*held == nullptr || !THPVariable_CheckExact(*held)) return false;
  *tensor = &THPVariable_Unpack(*held);
  return true;
}

// Whether `obj` (a LogpCall) is a common-case call (see the contract above); fills `call` if so.
bool common_case(PyObject* obj, Call* call) {
  if (!attr_is_none(obj, "tp_group")) return false;
  if (!tensor_attr(obj, "logits", &call->held[0], &call->logits) ||
      !tensor_attr(obj, "target_ids", &call->held[1], &call->ids) || !inputs_fit(*call->logits, *call->ids)) {
    return false;
  }
  call->device = call->logits->get_device();
  return call_scalars(obj, &call->temperature, &call->ignore_index, &call->call_id);
}

// ---------------------------------------------------------------- forward

PyObject* forward(PyObject*, PyObject* call_obj) {
  Call call;
  if (forward_kernels.empty() || !common_case(call_obj, &call) || !no_python_modes()) {
    PyErr_Clear();  // an attribute or conversion that failed is just "not the common case"
    Py_RETURN_NONE;
  }
  const at::Tensor& logits = *call.logits;
  const bool wants_grad = logits.requires_grad() && c10::GradMode::is_enabled();
  const uint64_t key = kernel_key(call.device, logits, *call.ids, call.ignore_index, call.temperature, wants_grad);
  const auto fwd = forward_kernels.find(key);
  const auto bwd = wants_grad ? backward_kernels.find(key) : backward_kernels.end();
  if (fwd == forward_kernels.end() || (wants_grad && bwd == backward_kernels.end())) Py_RETURN_NONE;
  try {
    uint64_t context = 0, word = 0;
    if (!launchable_now(call.device, &context, &word)) Py_RETURN_NONE;
    const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(call.device);
    const int64_t t = logits.size(0);
    const at::TensorOptions f32 = logits.options().dtype(at::kFloat);
    at::Tensor out;
    if (!wants_grad) {
      out = at::empty({t}, f32);
      launch_forward(fwd->second, logits, *call.ids, static_cast<char*>(out.data_ptr()), false, word,
                     call.temperature, call.ignore_index, call.call_id, current_stream(device));
    } else {
      at::Tensor stats = at::empty({3, t}, f32);
      launch_forward(fwd->second, logits, *call.ids, static_cast<char*>(stats.data_ptr()), true, word,
                     call.temperature, call.ignore_index, call.call_id, current_stream(device));
      {
        // row 0 as a plain tensor, not an autograd view of the statistics: it gets the node below
        at::AutoDispatchBelowADInplaceOrView below_views;
        out = stats.select(0, 0);
      }
      attach_logits_node<LogpBackward>(out, logits, *call.ids, bwd->second, call.temperature, call.ignore_index,
                                       context)->stats_ = std::move(stats);
    }
    served_calls.fetch_add(1, std::memory_order_relaxed);
    return THPVariable_Wrap(std::move(out));
  } catch (const std::exception& exc) {  // an allocation that failed (out of memory), a launch, ...
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
}

// ---------------------------------------------------------------- registration

// Stores `native` (a kernel the Python path launched for these inputs) in `registry` under its key;
// the Python result (True, False or None) or nullptr with an error. `kernel_args`: the kernel's
// arguments with the pointers zeroed, to check that its parameter letters fit them.
PyObject* register_kernel(std::unordered_map<uint64_t, TritonKernel>& registry, const char* what,
                          const at::Tensor& logits, const at::Tensor& ids, PyObject* temperature_obj,
                          PyObject* ignore_index_obj, bool stats, PyObject* native, const Arg* kernel_args,
                          int nargs) {
  const double temperature = PyFloat_AsDouble(temperature_obj);
  const long long ignore_index = PyLong_AsLongLong(ignore_index_obj);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  if (!driver_or_error()) return nullptr;
  TritonKernel kernel;
  if (!read_native(native, &kernel) || !check_fits(what, kernel, kernel_args, nargs)) return nullptr;
  const int device = logits.get_device();
  if (!remember_context(device)) return nullptr;
  if (!store(registry, kernel_key(device, logits, ids, ignore_index, temperature, stats), std::move(kernel))) {
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

PyObject* register_forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes("register_forward", nargs, 9)) return nullptr;
  const at::Tensor* t[4];
  if (!plain_tensors(args, 4, t) || (args[6] != Py_True && args[6] != Py_False)) Py_RETURN_NONE;
  const bool stats = args[6] == Py_True;
  if (!inputs_fit(*t[0], *t[1]) || !rows_fit(*t[2], *t[3], t[0]->size(0), stats)) Py_RETURN_NONE;
  const unsigned long long word = PyLong_AsUnsignedLongLong(args[8]);
  if (PyErr_Occurred()) return nullptr;
  if (!remember_error_word(t[0]->get_device(), word)) return nullptr;
  const int64_t v = t[0]->size(1);
  const Arg kernel_args[kForwardArgs] = {
      Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}),
      Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::integer(v), Arg::integer(v), Arg::integer(0),
      Arg::integer(v), Arg::integer(PyLong_AsLongLong(args[5])), Arg::f32(0.0), Arg::kept(0)};
  if (PyErr_Occurred()) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return register_kernel(forward_kernels, "forward", *t[0], *t[1], args[4], args[5], stats, args[7], kernel_args,
                         kForwardArgs);
}

PyObject* register_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes("register_backward", nargs, 8)) return nullptr;
  const at::Tensor* t[5];
  if (!plain_tensors(args, 5, t) || !inputs_fit(*t[0], *t[1])) Py_RETURN_NONE;
  const at::Tensor& grad_output = *t[2];
  const int64_t tokens = t[0]->size(0), v = t[0]->size(1);
  if (grad_output.scalar_type() != at::kFloat || grad_output.dim() != 1 || grad_output.size(0) != tokens ||
      !grad_output.is_contiguous() || !aligned(grad_output.data_ptr()) || !rows_fit(*t[3], *t[4], tokens, true)) {
    Py_RETURN_NONE;
  }
  const Arg kernel_args[kBackwardArgs] = {
      Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}),
      Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::integer(v), Arg::integer(v), Arg::integer(v),
      Arg::integer(0), Arg::integer(PyLong_AsLongLong(args[6])), Arg::f32(0.0)};
  if (PyErr_Occurred()) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return register_kernel(backward_kernels, "backward", *t[0], *t[1], args[5], args[6], true, args[7], kernel_args,
                         kBackwardArgs);
}

PyObject* clear(PyObject*, PyObject*) {
  forward_kernels.clear();
  backward_kernels.clear();
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    HOST_PATH_METHODS(
        "forward(call) -> logp | None (not the common case, or not registered)",
        "register_forward(logits, ids, row_max, sumexp, temperature, ignore_index, stats, native, error_word)"
        " -> True | False (the key holds another kernel) | None (not a common case)",
        "register_backward(logits, ids, grad_output, row_max, sumexp, temperature, ignore_index, native)"
        " -> True | False | None"),
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "logp_single_device", "logp's host fast path", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_logp_single_device(void) { return PyModule_Create(&module); }
