// ratio_kl's forward and its backward on the host fast path: one C++ call that accepts the common
// case, allocates the two outputs, launches the forward kernel and, where a gradient is wanted,
// attaches a C++ autograd node whose backward launches the backward kernel. Neither pass enters Python.
//
// Why: the op is elementwise, so a call's GPU time is small against its host time: a call of
// T <= 64 tokens is all host time, and a forward+backward of 2**24 tokens (~0.2 ms on the GPU) was
// host-bound through autograd.Function (its apply and its backward are Python frames the engine
// calls, with ~25 tensor attributes read to check and key the launches). Here the checks are field
// reads, each launch is one cuLaunchKernel, and the backward is a torch::autograd::Node (the engine
// calls it without the GIL).
//
// The contract with kernels/ops/ratio_kl.py (which builds this file with kernels/ops/host/build.py):
// * forward(logp, old_logp, ref_logp, mask, kl_code, unbiased) returns (ratio, kl), or None when the
//   call is not the common case or a kernel it needs is not registered yet. It never raises for bad
//   input: the Python path runs then, and its checks name the problem. The common case: four plain
//   tensors (torch.Tensor or Parameter), 1-D, contiguous, the same length T (0 < T <= INT32_MAX)
//   on the current CUDA device; logp fp32; old/ref fp32|bf16|fp16|fp64; mask bool or one of those;
//   kl_code 0..3 (KL_TYPES' index) and unbiased a bool; no torch function or dispatch mode active;
//   the current CUDA context the one the kernels were registered in. A call that wants a gradient
//   (logp requiring one, grad mode on) also needs its four inputs 16-byte aligned and the backward
//   kernel registered; its node saves the four inputs and differentiates to logp only, as
//   RatioKLFunction does.
// * register_forward(logp, old_logp, ref_logp, mask, kl_code, unbiased, block, native) stores the
//   forward kernel the Python path just launched for these inputs (kernels.launch.CachedLaunch's
//   native_launch tuple: CUfunction handle, threads per block, dynamic shared memory, parameter
//   letters); register_backward(logp, old_logp, ref_logp, mask, grad_ratio, grad_kl, kl_code,
//   unbiased, block, native) the backward kernel, for inputs 16-byte aligned and gradients that are
//   fp32 [T], contiguous and aligned. `block` is the tokens per program of both kernels (the grid is
//   ceil(T / block)); a registration with another block than the first raises. Each kernel is kept
//   under a key that holds everything Triton specializes it on (kernel_key); a register call
//   returns None (storing nothing) where the inputs are not the common case's, False where the key
//   already holds another kernel (the key would be too coarse: Python raises LaunchKeyError), else True.
// * clear() forgets every registered kernel; served() counts the calls forward served.
//
// Semantics kept from RatioKLFunction: the inputs saved as SavedVariables (saved-tensor hooks, the
// version-counter check, "backward through the graph a second time" after release); a backward
// through a retained graph recomputes from the inputs, as often as it is called; an undefined
// gradient counts as zeros; the forward's launch on the current stream, the backward's on the
// stream the engine makes current (the forward's), so CUDA-graph capture records both.
//
// The kernels' parameters, as Triton 3.6's launcher passes them (see host_common.h's pack): forward
// logp, old, ref, mask, ratio, kl, n; backward logp, old, ref, mask, grad_ratio, grad_kl, grad, n
// (n is left out when T == 1: Triton makes it a constexpr).

#include <Python.h>

#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "host_autograd.h"
#include "host_common.h"

const char host_common::kHostPath[] = "ratio_kl host path";

namespace {

using namespace host_common;

constexpr int kForwardArgs = 7;
constexpr int kBackwardArgs = 8;

std::unordered_map<uint64_t, TritonKernel> forward_kernels, backward_kernels;
int64_t elementwise_block = 0;  // tokens per program of every registered kernel (0: none registered)

// Whether the four inputs are the common case's (see the contract above; logp fp32, the others
// floating point, the mask bool too).
bool inputs_fit(const at::Tensor* const* inputs) {
  const at::Tensor& logp = *inputs[0];
  if (logp.dim() != 1 || logp.scalar_type() != at::kFloat || !logp.is_cuda() || !logp.is_contiguous()) return false;
  const int64_t n = logp.size(0);
  if (n <= 0 || n > kInt32Max) return false;
  for (int i = 1; i < 4; ++i) {
    const at::Tensor& t = *inputs[i];
    if (t.dim() != 1 || t.size(0) != n || !t.is_cuda() || t.get_device() != logp.get_device() || !t.is_contiguous()) {
      return false;
    }
    const int code = dtype_code(t.scalar_type());
    if (code < 0 || code > 4 || (code == 4 && i != 3)) return false;  // floating, or a bool mask
  }
  return true;
}

bool all_aligned(const at::Tensor* const* inputs) {
  for (int i = 0; i < 4; ++i) {
    if (!aligned(inputs[i]->data_ptr())) return false;
  }
  return true;
}

// What Triton specializes both kernels on, given inputs that fit: the device, the three input dtypes
// that vary, each input's 16-byte alignment, T == 1 and T % 16 == 0, the KL type and the unbiased
// flag. The outputs and the backward's gradients are fresh or checked fp32 [T] (aligned).
uint64_t kernel_key(const at::Tensor* const* inputs, int64_t kl_code, bool unbiased) {
  const int64_t n = inputs[0]->size(0);
  uint64_t key = static_cast<uint64_t>(inputs[0]->get_device());
  for (int i = 1; i < 4; ++i) key = key << 3 | static_cast<uint64_t>(dtype_code(inputs[i]->scalar_type()));
  for (int i = 0; i < 4; ++i) key = key << 1 | (aligned(inputs[i]->data_ptr()) ? 1u : 0u);
  key = key << 1 | (n == 1 ? 1u : 0u);
  key = key << 1 | (n % 16 == 0 ? 1u : 0u);
  key = key << 2 | static_cast<uint64_t>(kl_code);
  return key << 1 | (unbiased ? 1u : 0u);
}

unsigned grid_of(int64_t n) { return static_cast<unsigned>((n + elementwise_block - 1) / elementwise_block); }

// kl_code (0..3) and unbiased (a bool) from args[0] and args[1], or false (no Python error left).
bool kl_flags(PyObject* const* args, int64_t* kl_code, bool* unbiased) {
  const long code = PyLong_AsLong(args[0]);
  if (code == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (code < 0 || code > 3 || (args[1] != Py_True && args[1] != Py_False)) return false;
  *kl_code = code;
  *unbiased = args[1] == Py_True;
  return true;
}

// ---------------------------------------------------------------- the backward node

struct RatioKLBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable inputs_[4];  // logp, old_logp, ref_logp, mask
  TritonKernel kernel_;
  int device_ = 0;
  uint64_t context_ = 0;

  std::string name() const override { return "RatioKLBackward"; }

  void release_variables() override {
    for (auto& saved : inputs_) saved.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor inputs[4];
    for (int i = 0; i < 4; ++i) {
      // raises if released (a second backward without retain_graph) or modified in place
      inputs[i] = inputs_[i].unpack();
      if (!inputs[i].is_cuda() || inputs[i].get_device() != device_) {
        throw std::runtime_error(std::string(kHostPath) + ": a saved input is not on cuda:" + std::to_string(device_) +
                                 " any more (a saved-tensor hook moved it)");
      }
      // the backward kernel is the aligned inputs' specialization
      inputs[i] = fitting(inputs[i], inputs[i].scalar_type());
    }
    const int64_t n = inputs[0].size(0);
    const at::TensorOptions f32 = inputs[0].options().dtype(at::kFloat);
    const at::Tensor g_ratio = grads[0].defined() ? fitting(grads[0], at::kFloat) : at::zeros({n}, f32);
    const at::Tensor g_kl = grads[1].defined() ? fitting(grads[1], at::kFloat) : at::zeros({n}, f32);
    make_current(context_);
    at::Tensor grad = at::empty_like(inputs[0]);
    const Arg args[kBackwardArgs] = {
        Arg::ptr(inputs[0].data_ptr()), Arg::ptr(inputs[1].data_ptr()), Arg::ptr(inputs[2].data_ptr()),
        Arg::ptr(inputs[3].data_ptr()), Arg::ptr(g_ratio.data_ptr()), Arg::ptr(g_kl.data_ptr()),
        Arg::ptr(grad.data_ptr()), Arg::integer(n)};
    launch_triton("backward", kernel_, grid_of(n), current_stream(static_cast<c10::DeviceIndex>(device_)), args,
                  kBackwardArgs);
    return {grad};
  }
};

// ---------------------------------------------------------------- forward

PyObject* forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes("forward", nargs, 6)) return nullptr;
  const at::Tensor* inputs[4];
  int64_t kl_code = 0;
  bool unbiased = false;
  if (forward_kernels.empty() || !plain_tensors(args, 4, inputs) || !kl_flags(args + 4, &kl_code, &unbiased) ||
      !inputs_fit(inputs) || !no_python_modes()) {
    Py_RETURN_NONE;
  }
  const at::Tensor& logp = *inputs[0];
  const bool wants_grad = logp.requires_grad() && c10::GradMode::is_enabled();
  if (wants_grad && !all_aligned(inputs)) Py_RETURN_NONE;
  const uint64_t key = kernel_key(inputs, kl_code, unbiased);
  const auto fwd = forward_kernels.find(key);
  const auto bwd = wants_grad ? backward_kernels.find(key) : backward_kernels.end();
  if (fwd == forward_kernels.end() || (wants_grad && bwd == backward_kernels.end())) Py_RETURN_NONE;
  const int device = logp.get_device();
  uint64_t context = 0;
  if (!context_now(device, &context)) Py_RETURN_NONE;
  try {
    at::Tensor ratio = at::empty_like(logp);
    at::Tensor kl = at::empty_like(logp);
    const int64_t n = logp.size(0);
    const Arg launch_args[kForwardArgs] = {
        Arg::ptr(logp.data_ptr()), Arg::ptr(inputs[1]->data_ptr()), Arg::ptr(inputs[2]->data_ptr()),
        Arg::ptr(inputs[3]->data_ptr()), Arg::ptr(ratio.data_ptr()), Arg::ptr(kl.data_ptr()), Arg::integer(n)};
    launch_triton("forward", fwd->second, grid_of(n), current_stream(static_cast<c10::DeviceIndex>(device)),
                  launch_args, kForwardArgs);
    if (wants_grad) {
      auto node = make_node<NodePtr, RatioKLBackward>();
      RatioKLBackward* raw = static_cast<RatioKLBackward*>(node.get());
      raw->set_next_edges(torch::autograd::collect_next_edges(logp));
      for (int i = 0; i < 4; ++i) raw->inputs_[i] = torch::autograd::SavedVariable(*inputs[i], false);
      raw->kernel_ = bwd->second;
      raw->device_ = device;
      raw->context_ = context;
      torch::autograd::create_gradient_edge(ratio, node);  // output 0
      torch::autograd::create_gradient_edge(kl, std::move(node));  // output 1
    }
    served_calls.fetch_add(1, std::memory_order_relaxed);
    PyObject* out = PyTuple_New(2);
    if (out == nullptr) return nullptr;
    PyTuple_SET_ITEM(out, 0, THPVariable_Wrap(std::move(ratio)));
    PyTuple_SET_ITEM(out, 1, THPVariable_Wrap(std::move(kl)));
    return out;
  } catch (const std::exception& exc) {  // an allocation that failed (out of memory), a launch, ...
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
}

// ---------------------------------------------------------------- registration

// Stores `native` (a kernel the Python path launched for these inputs) in `registry`; the Python
// result (True, False or None) or nullptr with an error. `kernel_args`: the kernel's arguments with
// the pointers zeroed, to check that its parameter letters fit them.
PyObject* register_kernel(std::unordered_map<uint64_t, TritonKernel>& registry, const char* what,
                          const at::Tensor* const* inputs, PyObject* const* flags, PyObject* block_obj,
                          PyObject* native, const Arg* kernel_args, int nargs) {
  int64_t kl_code = 0;
  bool unbiased = false;
  if (!kl_flags(flags, &kl_code, &unbiased)) Py_RETURN_NONE;
  const long long block = PyLong_AsLongLong(block_obj);
  if (PyErr_Occurred()) return nullptr;
  if (block <= 0 || (elementwise_block != 0 && block != elementwise_block)) {
    PyErr_Format(PyExc_ValueError, "%s: block %lld (tokens per program) differs from the registered kernels' %lld",
                 kHostPath, block, static_cast<long long>(elementwise_block));
    return nullptr;
  }
  if (!driver_or_error()) return nullptr;
  TritonKernel kernel;
  if (!read_native(native, &kernel) || !check_fits(what, kernel, kernel_args, nargs)) return nullptr;
  if (!remember_context(inputs[0]->get_device())) return nullptr;
  elementwise_block = block;
  if (!store(registry, kernel_key(inputs, kl_code, unbiased), std::move(kernel))) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
}

PyObject* register_forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes("register_forward", nargs, 8)) return nullptr;
  const at::Tensor* inputs[4];
  if (!plain_tensors(args, 4, inputs) || !inputs_fit(inputs)) Py_RETURN_NONE;
  const Arg kernel_args[kForwardArgs] = {
      Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}),
      Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::integer(inputs[0]->size(0))};
  return register_kernel(forward_kernels, "forward", inputs, args + 4, args[6], args[7], kernel_args, kForwardArgs);
}

PyObject* register_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes("register_backward", nargs, 10)) return nullptr;
  const at::Tensor* tensors[6];
  if (!plain_tensors(args, 6, tensors) || !inputs_fit(tensors) || !all_aligned(tensors)) Py_RETURN_NONE;
  const int64_t n = tensors[0]->size(0);
  for (int i = 4; i < 6; ++i) {
    const at::Tensor& g = *tensors[i];
    if (g.scalar_type() != at::kFloat || g.dim() != 1 || g.size(0) != n || !g.is_cuda() ||
        g.get_device() != tensors[0]->get_device() || !g.is_contiguous() || !aligned(g.data_ptr())) {
      Py_RETURN_NONE;
    }
  }
  const Arg kernel_args[kBackwardArgs] = {
      Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}),
      Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::integer(n)};
  return register_kernel(backward_kernels, "backward", tensors, args + 6, args[8], args[9], kernel_args,
                         kBackwardArgs);
}

PyObject* clear(PyObject*, PyObject*) {
  forward_kernels.clear();
  backward_kernels.clear();
  elementwise_block = 0;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"forward", fastcall(forward), METH_FASTCALL,
     "forward(logp, old_logp, ref_logp, mask, kl_code, unbiased) -> (ratio, kl) | None (not the common case, "
     "or not registered)"},
    {"register_forward", fastcall(register_forward), METH_FASTCALL,
     "register_forward(logp, old_logp, ref_logp, mask, kl_code, unbiased, block, native)"
     " -> True | False (the key holds another kernel) | None (not a common case)"},
    {"register_backward", fastcall(register_backward), METH_FASTCALL,
     "register_backward(logp, old_logp, ref_logp, mask, grad_ratio, grad_kl, kl_code, unbiased, block, native)"
     " -> True | False | None"},
    {"clear", clear, METH_NOARGS, "forget every registered kernel"},
    {"served", host_common::served, METH_NOARGS, "calls the host path has served in this process"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "ratio_kl_elementwise", "ratio_kl's host fast path", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_ratio_kl_elementwise(void) { return PyModule_Create(&module); }
