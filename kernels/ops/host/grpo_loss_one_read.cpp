// grpo_loss's one-read forward and its backward on the host fast path: one C++ call that accepts the
// common case, allocates the outputs, launches the forward's three kernels and attaches a C++
// autograd node whose backward launches the write kernel. Neither the forward nor the backward
// enters Python.
//
// One file of ~710 lines on purpose: kernels/ops/host/build.py builds each host module from one
// .cpp (with host_common.h, the part the ops share), and the forward, its autograd node and the
// kernel registry share this op's checks, keys and launch records.
//
// Why: a launch-bound grpo_loss forward+backward is all host time, and most of it is Python:
// autograd.Function's apply and its backward (each a Python frame the engine calls), three Triton
// launches, a ctypes launch, five allocations. Here the checks are field reads, every launch is one
// cuLaunchKernel, and the backward is a torch::autograd::Node (the engine calls it without the GIL).
//
// The contract with kernels/ops/grpo_loss.py (which builds this file with kernels/ops/host/build.py):
// * forward(call) returns (loss, {pg_loss, pg_clipfrac, ppo_kl, kl_loss}) as the Python path does,
//   or None when the call is not the common case or a kernel it needs is not registered yet. It
//   never raises for bad input: the Python path runs then, and its checks name the problem. The
//   common case (beyond what the contract, GrpoLossCall, has checked): no tp_group, no GSPO, no
//   inplace_backward; logits a plain tensor [T, V] (T, V < 2**31) fp32|bf16|fp16, contiguous,
//   16-byte aligned, on the current CUDA device, needing a gradient (grad mode on); target_ids
//   int64 contiguous; old_logp, advantages (and ref_logp, rollout_logp where used) fp32
//   contiguous; loss_mask contiguous bool|fp32|bf16|fp16|fp64; lengths / cu_seqlens absent or
//   int64|int32 contiguous on the same device; no torch function or dispatch mode active; the
//   current CUDA context the one the kernels were registered in.
// * register_forward(call, weights, one_read, sums) stores the kernels the Python path just
//   launched for this call: weights and sums as kernels.launch.CachedLaunch.native_launch's tuple
//   (CUfunction handle, threads per block, dynamic shared memory, parameter letters), one_read as
//   (CUfunction handle of kernels/ops/cuda/grpo_loss_one_read.cu's kernel, cluster size, slice
//   columns, threads, dynamic shared memory). register_backward(logits, write) stores the
//   backward's write kernel (grpo_write_from_stats_*) as kernels.ops.cuda.grpo_loss_one_read's
//   WriteLaunch tuple (CUfunction handle, the grid's cap, threads, dynamic shared memory, blocks per
//   row, block columns) under (device, dtype, V). Each kernel is kept under a key of its own that
//   holds everything it is specialized on (see the *_key functions); a register call returns None
//   (storing nothing) where the call is not the common case, False where a key already holds
//   another kernel (the key would be too coarse: Python raises LaunchKeyError), else True.
// * The incoming gradient the forward writes dlogits for, as GrpoLossFunction does: the device's
//   error word's word 3 (kernels/device_errors.py: the last backward's gradient, bits XOR bits(1.0f)),
//   read from pinned host memory without a wait; the node keeps it and its write kernel rewrites the
//   rows only when the actual gradient (read on the device) has other bits.
// * configure(metric_names, second_backward): the metrics' dict keys, and the Python function a
//   second backward through a retained graph calls (the forward's dlogits were handed out by the
//   first one: that backward writes fresh rows, as GrpoLossFunction.backward does). clear() forgets
//   every registered kernel; served() counts the calls forward served (for tests and tags).
// * phases(on) switches on (or off) a clock around each phase of forward and of the node's apply and
//   returns what was measured since the last call, as {phase: mean us per call} (for the host-time
//   probe, tools/probes/probe_grpo_loss_host.py; off, it costs one branch per phase).
//
// Semantics kept from GrpoLossFunction: logits and ids saved as SavedVariables (saved-tensor hooks,
// the version-counter check, "backward through the graph a second time" after release); dlogits
// handed out once; grad_output read on the device (rows rewritten only if it is not the predicted one);
// metrics not differentiable; the forward's launches on the current stream, the backward's on the
// stream the engine makes current (the forward's), so CUDA-graph capture records both.
//
// Triton 3.6's launcher passes a kernel's runtime parameters in signature order, an int equal to 1
// left out (a constexpr to Triton) unless do_not_specialize names it, then the global and profile
// scratch pointers (null: kernels that need scratch are never registered).

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/unbind.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "host_autograd.h"
#include "host_common.h"

const char host_common::kHostPath[] = "grpo_loss host path";

namespace {

using namespace host_common;

// ---------------------------------------------------------------- kernels and their launch

struct OneReadKernel {
  uint64_t function = 0;
  int64_t cluster = 0;
  int64_t slice = 0;
  unsigned threads = 0;
  unsigned shared = 0;
};

// grpo_write_from_stats_<dtype> for rows of one V (kernels/ops/cuda/grpo_loss_one_read.py, WriteLaunch)
struct WriteKernel {
  uint64_t function = 0;
  int64_t ctas = 0;  // the grid's cap: one wave
  unsigned threads = 0;
  unsigned shared = 0;
  int32_t blocks_per_row = 0;
  int32_t block_cols = 0;
  bool operator==(const WriteKernel& o) const {
    return function == o.function && ctas == o.ctas && threads == o.threads && shared == o.shared &&
           blocks_per_row == o.blocks_per_row && block_cols == o.block_cols;
  }
};

// ---------------------------------------------------------------- registries

std::unordered_map<uint64_t, TritonKernel> weights_kernels, sums_kernels;
std::unordered_map<uint64_t, OneReadKernel> one_read_kernels;
std::unordered_map<uint64_t, WriteKernel> write_kernels;  // under one_read_key
// the error word's word 3 (kernels/device_errors.py): the last backward's gradient, bits XOR bits(1.0f)
constexpr int kLastGrad = 3;
constexpr uint32_t kOneBits = 0x3f800000u;
PyObject* metric_names[4] = {nullptr, nullptr, nullptr, nullptr};
PyObject* second_backward = nullptr;

// The phases(on) clock: ns per phase summed over the calls since the last phases() call.
enum Phase { kChecks, kAlloc, kWeights, kOneRead, kSums, kNode, kOutputs, kBackward, kPhases };
const char* const phase_names[kPhases] = {"checks", "allocations", "token_weights_launch", "one_read_launch",
                                          "weighted_sums_launch", "autograd_node", "outputs", "backward_apply"};
std::atomic<bool> timing{false};
std::atomic<int64_t> phase_ns[kPhases];
std::atomic<int64_t> phase_calls[kPhases];

struct PhaseClock {
  bool on = timing.load(std::memory_order_relaxed);
  std::chrono::steady_clock::time_point last = on ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  void mark(Phase phase) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    phase_ns[phase].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count(),
                              std::memory_order_relaxed);
    phase_calls[phase].fetch_add(1, std::memory_order_relaxed);
    last = now;
  }
};

// ---------------------------------------------------------------- the call's common case

struct Config {
  PyObject* object = nullptr;  // the LossConfig these values were read from (a reference is held)
  double eps_low, eps_high, eps_c, kl_coef, tis_low, tis_high;
  bool dual_clip, unbiased, tis, per_token, gspo;
  int kl_code;
};

Config config_cache;

bool read_double(PyObject* obj, const char* name, double* out) {
  PyObject* value = get_attr(obj, name);
  if (value == nullptr) return false;
  const bool ok = PyFloat_Check(value) || PyLong_Check(value);
  if (ok) *out = PyFloat_AsDouble(value);
  Py_DECREF(value);
  return ok && !PyErr_Occurred();
}

int read_flag(PyObject* obj, const char* name) {  // 1, 0, or -1 (not a bool)
  PyObject* value = get_attr(obj, name);
  if (value == nullptr) return -1;
  const int out = value == Py_True ? 1 : value == Py_False ? 0 : -1;
  Py_DECREF(value);
  return out;
}

bool read_choice(PyObject* obj, const char* name, const char* const* choices, int n, int* out) {
  PyObject* value = get_attr(obj, name);
  if (value == nullptr) return false;
  const char* text = PyUnicode_Check(value) ? PyUnicode_AsUTF8(value) : nullptr;
  *out = -1;
  for (int i = 0; text != nullptr && i < n; ++i) {
    if (std::string(text) == choices[i]) *out = i;
  }
  Py_DECREF(value);
  return *out >= 0;
}

// The LossConfig's values (frozen: read once per config object, kept with a reference to it).
const Config* read_config(PyObject* obj) {
  if (obj == config_cache.object) return &config_cache;
  static const char* const kl_types[] = {"k1", "k2", "k3", "low_var_kl"};
  static const char* const reductions[] = {"sum_of_sample_mean", "per_token_sum"};
  Config c;
  PyObject* eps_c = get_attr(obj, "eps_clip_c");
  if (eps_c == nullptr) return nullptr;
  c.dual_clip = eps_c != Py_None;
  c.eps_c = 0.0;
  if (c.dual_clip) {
    if (PyFloat_Check(eps_c) || PyLong_Check(eps_c)) c.eps_c = PyFloat_AsDouble(eps_c);
    else c.dual_clip = false, c.eps_c = -1.0;
  }
  Py_DECREF(eps_c);
  if (c.eps_c < 0.0 || PyErr_Occurred()) return nullptr;
  const int unbiased = read_flag(obj, "use_unbiased_kl"), tis = read_flag(obj, "use_tis"),
            gspo = read_flag(obj, "gspo");
  int reduction = -1;
  if (!read_double(obj, "eps_clip", &c.eps_low) || !read_double(obj, "eps_clip_high", &c.eps_high) ||
      !read_double(obj, "kl_loss_coef", &c.kl_coef) || !read_double(obj, "tis_clip_low", &c.tis_low) ||
      !read_double(obj, "tis_clip_high", &c.tis_high) || unbiased < 0 || tis < 0 || gspo < 0 ||
      !read_choice(obj, "kl_type", kl_types, 4, &c.kl_code) || !read_choice(obj, "reduction", reductions, 2, &reduction)) {
    return nullptr;
  }
  c.unbiased = unbiased, c.tis = tis, c.gspo = gspo, c.per_token = reduction == 1;
  Py_INCREF(obj);
  Py_XDECREF(config_cache.object);
  c.object = obj;
  config_cache = c;
  return &config_cache;
}

struct Call {
  const at::Tensor* logits;
  const at::Tensor* ids;
  const at::Tensor* old_logp;
  const at::Tensor* ref_logp;       // null: no reference (old_logp stands in)
  const at::Tensor* advantages;
  const at::Tensor* rollout_logp;   // null unless use_tis
  const at::Tensor* loss_mask;
  const at::Tensor* offsets;        // lengths, cu_seqlens or (kind 0) the mask
  int offsets_kind;                 // 0 none, 1 lengths, 2 cu_seqlens
  int64_t samples;
  int64_t t, v;
  int device;
  double temperature;
  int64_t ignore_index, call_id;
  const Config* config;
  // holds the attribute references the tensor pointers above point into
  PyObject* held[9];
  int nheld = 0;
  ~Call() {
    for (int i = 0; i < nheld; ++i) Py_DECREF(held[i]);
  }
};

// The call's attribute `name` as a plain tensor (nullptr if it is None where `optional`), or false.
bool tensor_attr(PyObject* call, const char* name, bool optional, Call* out, const at::Tensor** tensor) {
  PyObject* value = get_attr(call, name);
  if (value == nullptr) return false;
  out->held[out->nheld++] = value;
  if (value == Py_None) {
    *tensor = nullptr;
    return optional;
  }
  if (!THPVariable_CheckExact(value)) return false;
  *tensor = &THPVariable_Unpack(value);
  return true;
}

bool token_vector(const at::Tensor* t, int64_t n, int device, bool fp32_only) {
  if (t == nullptr || t->dim() != 1 || t->size(0) != n || !t->is_cuda() || t->get_device() != device ||
      !t->is_contiguous()) {
    return false;
  }
  return !fp32_only || t->scalar_type() == at::kFloat;
}

// Whether `obj` (a GrpoLossCall) is a common-case call (see the contract above); fills `call` if so.
bool common_case(PyObject* obj, Call* call) {
  if (!attr_is_none(obj, "tp_group") || read_flag(obj, "inplace_backward") != 0) return false;
  PyObject* config = get_attr(obj, "config");
  if (config == nullptr) return false;
  call->config = read_config(config);
  Py_DECREF(config);  // read_config holds its own reference
  if (call->config == nullptr || call->config->gspo) return false;
  if (!tensor_attr(obj, "logits", false, call, &call->logits)) return false;
  const at::Tensor& logits = *call->logits;
  if (logits.dim() != 2 || !logits.is_cuda() || !logits.requires_grad() || !c10::GradMode::is_enabled()) return false;
  const int code = dtype_code(logits.scalar_type());
  if (code < 0 || code > 2 || !logits.is_contiguous() || !aligned(logits.data_ptr())) return false;
  call->t = logits.size(0), call->v = logits.size(1);
  if (call->t <= 0 || call->v <= 0 || call->t > kInt32Max || call->v > kInt32Max) return false;
  call->device = logits.get_device();
  const at::Tensor* mask = nullptr;
  if (!tensor_attr(obj, "target_ids", false, call, &call->ids) || !tensor_attr(obj, "old_logp", false, call, &call->old_logp) ||
      !tensor_attr(obj, "ref_logp", true, call, &call->ref_logp) ||
      !tensor_attr(obj, "advantages", false, call, &call->advantages) ||
      !tensor_attr(obj, "loss_mask", false, call, &mask)) {
    return false;
  }
  call->loss_mask = mask;
  const int64_t t = call->t;
  if (!token_vector(call->ids, t, call->device, false) || call->ids->scalar_type() != at::kLong) return false;
  if (!token_vector(call->old_logp, t, call->device, true) || !token_vector(call->advantages, t, call->device, true)) return false;
  if (call->ref_logp != nullptr && !token_vector(call->ref_logp, t, call->device, true)) return false;
  const int mask_code = dtype_code(mask->scalar_type());
  if (!token_vector(mask, t, call->device, false) || mask_code < 0 || mask_code > 4) return false;
  call->rollout_logp = nullptr;
  if (call->config->tis) {
    if (!tensor_attr(obj, "rollout_logp", false, call, &call->rollout_logp) ||
        !token_vector(call->rollout_logp, t, call->device, true)) {
      return false;
    }
  }
  const at::Tensor *lengths = nullptr, *cu_seqlens = nullptr;
  if (!tensor_attr(obj, "lengths", true, call, &lengths) || !tensor_attr(obj, "cu_seqlens", true, call, &cu_seqlens)) return false;
  if (lengths != nullptr && cu_seqlens != nullptr) return false;
  const at::Tensor* offsets = lengths != nullptr ? lengths : cu_seqlens;
  if (offsets != nullptr) {
    const int off_code = dtype_code(offsets->scalar_type());
    if ((off_code != 5 && off_code != 6) || offsets->dim() != 1 || !offsets->is_cuda() ||
        offsets->get_device() != call->device || !offsets->is_contiguous()) {
      return false;
    }
    call->offsets = offsets;
    call->offsets_kind = lengths != nullptr ? 1 : 2;
    call->samples = lengths != nullptr ? offsets->size(0) : offsets->size(0) - 1;
    if (call->samples <= 0) return false;
  } else {
    call->offsets = mask;
    call->offsets_kind = 0;
    call->samples = 1;
  }
  return call_scalars(obj, &call->temperature, &call->ignore_index, &call->call_id);
}

// ---------------------------------------------------------------- keys (what Triton specializes each kernel on)

uint64_t weights_key(const Call& c) {
  uint64_t key = static_cast<uint64_t>(c.device);
  key = key << 3 | static_cast<uint64_t>(dtype_code(c.loss_mask->scalar_type()));
  key = key << 1 | (aligned(c.loss_mask->data_ptr()) ? 1u : 0u);
  key = key << 2 | static_cast<uint64_t>(c.offsets_kind);
  key = key << 3 | static_cast<uint64_t>(dtype_code(c.offsets->scalar_type()));
  key = key << 1 | (aligned(c.offsets->data_ptr()) ? 1u : 0u);
  key = key << 3 | int_bits(c.t);
  key = key << 2 | rows_bits(c.t);
  key = key << 3 | int_bits(c.samples);
  key = key << 1 | (c.config->per_token ? 1u : 0u);
  return key;
}

uint64_t sums_key(const Call& c) {
  uint64_t key = static_cast<uint64_t>(c.device);
  key = key << 3 | int_bits(c.t);
  key = key << 2 | rows_bits(c.t);
  key = key << 1 | (c.config->kl_coef != 0.0 ? 1u : 0u);
  return key;
}

uint64_t one_read_key(int device, at::ScalarType dtype, int64_t v) {
  return (static_cast<uint64_t>(device) << 40) | (static_cast<uint64_t>(dtype_code(dtype)) << 32) |
         static_cast<uint64_t>(v);
}

// ---------------------------------------------------------------- the backward node

struct GrpoLossBackward : public LogitsBackward {
  at::Tensor per_token_;     // rows 4-6: coef, row max, sum-exp; row 7: the reduction weights
  at::Tensor forward_grad_;  // dlogits for grad_pred_, written by the forward; handed out once
  float grad_pred_ = 1.0f;   // the incoming gradient the forward predicted
  uint64_t last_grad_ = 0;   // the error word's word 3: the write kernel stores the actual gradient there
  WriteKernel write_;

  std::string name() const override { return "GrpoLossBackward"; }

  void release_variables() override {
    LogitsBackward::release_variables();
    per_token_.reset();
    forward_grad_.reset();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    PhaseClock clock;
    at::Tensor logits = logits_.unpack();  // raises if released (a second backward) or modified in place
    at::Tensor ids = ids_.unpack();
    at::Tensor grad_output = grads[0].defined() ? grads[0] : at::zeros({}, logits.options().dtype(at::kFloat));
    if (!forward_grad_.defined()) return {second(logits, ids, grad_output)};
    if (grad_output.scalar_type() != at::kFloat) grad_output = grad_output.to(at::kFloat);
    make_current(context_);
    at::Tensor grad = std::move(forward_grad_);
    const int64_t t = logits.size(0);
    char* rows = static_cast<char*>(per_token_.data_ptr());
    const int64_t row_bytes = 4 * t;
    uint64_t ptrs[9] = {
        reinterpret_cast<uintptr_t>(logits.data_ptr()), reinterpret_cast<uintptr_t>(grad.data_ptr()),
        reinterpret_cast<uintptr_t>(ids.data_ptr()), reinterpret_cast<uintptr_t>(rows + 7 * row_bytes),
        reinterpret_cast<uintptr_t>(rows + 4 * row_bytes), reinterpret_cast<uintptr_t>(rows + 5 * row_bytes),
        reinterpret_cast<uintptr_t>(rows + 6 * row_bytes), reinterpret_cast<uintptr_t>(grad_output.data_ptr()),
        last_grad_};
    int64_t stride = logits.size(1);
    int32_t num_rows = static_cast<int32_t>(t), vocab = static_cast<int32_t>(logits.size(1));
    int32_t blocks_per_row = write_.blocks_per_row, block_cols = write_.block_cols;
    float temperature = static_cast<float>(temperature_), expected = grad_pred_;
    int32_t flags = temperature_ != 1.0 ? 1 : 0;
    void* params[18];
    for (int i = 0; i < 9; ++i) params[i] = &ptrs[i];
    params[9] = &stride, params[10] = &stride, params[11] = &num_rows, params[12] = &vocab;
    params[13] = &blocks_per_row, params[14] = &block_cols, params[15] = &temperature, params[16] = &expected;
    params[17] = &flags;
    const int64_t grid = std::min(t * blocks_per_row, write_.ctas);
    launch_or_throw("write", write_.function, static_cast<unsigned>(grid), write_.threads, write_.shared,
                    current_stream(device_), params);
    clock.mark(kBackward);
    return {grad};
  }

  // A backward after the first (retain_graph): the forward's dlogits are handed out, so fresh rows
  // are written by the Python path's backward (rare: its host time does not matter).
  at::Tensor second(const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& grad_output) {
    PyGILState_STATE gil = PyGILState_Ensure();
    try {
      if (second_backward == nullptr) throw std::runtime_error("grpo_loss host path: configure() was not called");
      PyObject* out = PyObject_CallFunction(
          second_backward, "NNNNd", THPVariable_Wrap(logits), THPVariable_Wrap(ids),
          THPVariable_Wrap(per_token_.narrow(0, 4, 4)), THPVariable_Wrap(grad_output), temperature_);
      if (out == nullptr) throw_python_error("grpo_loss backward");
      if (!THPVariable_Check(out)) {
        Py_DECREF(out);
        throw std::runtime_error("grpo_loss host path: second_backward did not return a tensor");
      }
      at::Tensor grad = THPVariable_Unpack(out);
      Py_DECREF(out);
      PyGILState_Release(gil);
      return grad;
    } catch (...) {
      PyGILState_Release(gil);
      throw;
    }
  }
};

// ---------------------------------------------------------------- forward

PyObject* forward(PyObject*, PyObject* call_obj) {
  PhaseClock clock;
  Call call;
  if (write_kernels.empty() || !common_case(call_obj, &call) || !no_python_modes()) {
    PyErr_Clear();  // an attribute or conversion that failed is just "not the common case"
    Py_RETURN_NONE;
  }
  const auto weights = weights_kernels.find(weights_key(call));
  const uint64_t rows_key = one_read_key(call.device, call.logits->scalar_type(), call.v);
  const auto one_read = one_read_kernels.find(rows_key);
  const auto sums = sums_kernels.find(sums_key(call));
  const auto write = write_kernels.find(rows_key);
  if (weights == weights_kernels.end() || one_read == one_read_kernels.end() || sums == sums_kernels.end() ||
      write == write_kernels.end()) {
    Py_RETURN_NONE;
  }
  try {
    uint64_t context = 0, err = 0;
    if (!launchable_now(call.device, &context, &err)) Py_RETURN_NONE;
    // the predicted incoming gradient: the last backward's (word 3; a stale read only predicts worse)
    const uint32_t pred_bits =
        static_cast<uint32_t>(reinterpret_cast<const volatile int64_t*>(err)[kLastGrad]) ^ kOneBits;
    float grad_pred;
    std::memcpy(&grad_pred, &pred_bits, sizeof(grad_pred));
    const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(call.device);
    void* stream = current_stream(device);
    const at::Tensor& logits = *call.logits;
    const Config& cfg = *call.config;
    const int64_t t = call.t, v = call.v;
    const at::TensorOptions f32 = logits.options().dtype(at::kFloat);
    clock.mark(kChecks);
    at::Tensor per_token = at::empty({8, t}, f32);
    at::Tensor forward_grad = at::empty({t, v}, logits.options());
    at::Tensor metrics = at::empty({4}, f32);
    at::Tensor loss = at::empty({}, f32);
    clock.mark(kAlloc);
    char* rows = static_cast<char*>(per_token.data_ptr());
    char* weights_ptr = rows + 7 * 4 * t;
    {
      const Arg args[] = {Arg::ptr(call.loss_mask->data_ptr()), Arg::ptr(call.offsets->data_ptr()),
                          Arg::ptr(weights_ptr), Arg::ptr(err), Arg::integer(t), Arg::integer(call.samples),
                          Arg::kept(call.call_id)};
      launch_triton("token weights", weights->second, static_cast<unsigned>(call.samples), stream, args, 7);
    }
    clock.mark(kWeights);
    {
      const OneReadKernel& k = one_read->second;
      const bool has_ref = call.ref_logp != nullptr;
      int32_t flags = call.config->kl_code << 8;
      if (call.temperature != 1.0) flags |= 1;
      if (has_ref) flags |= 2;
      if (cfg.unbiased) flags |= 4;
      if (cfg.dual_clip) flags |= 8;
      if (cfg.tis) flags |= 16;
      void* old = call.old_logp->data_ptr();
      uint64_t ptrs[9] = {
          reinterpret_cast<uintptr_t>(logits.data_ptr()), reinterpret_cast<uintptr_t>(forward_grad.data_ptr()),
          reinterpret_cast<uintptr_t>(call.ids->data_ptr()), reinterpret_cast<uintptr_t>(old),
          reinterpret_cast<uintptr_t>(has_ref ? call.ref_logp->data_ptr() : old),
          reinterpret_cast<uintptr_t>(call.advantages->data_ptr()),
          reinterpret_cast<uintptr_t>(cfg.tis ? call.rollout_logp->data_ptr() : old),
          reinterpret_cast<uintptr_t>(weights_ptr), reinterpret_cast<uintptr_t>(rows)};
      int64_t stride_row = v, stride_grad = v, ignore_index = call.ignore_index, call_id = call.call_id;
      int32_t num_tokens = static_cast<int32_t>(t), vocab = static_cast<int32_t>(v),
              slice = static_cast<int32_t>(k.slice);
      float scalars[7] = {static_cast<float>(call.temperature), static_cast<float>(cfg.eps_low),
                          static_cast<float>(cfg.eps_high), static_cast<float>(cfg.eps_c),
                          static_cast<float>(cfg.tis_low), static_cast<float>(cfg.tis_high),
                          static_cast<float>(cfg.kl_coef)};
      uint64_t word_ptr = err;
      void* params[26];
      for (int i = 0; i < 9; ++i) params[i] = &ptrs[i];
      params[9] = &stride_row, params[10] = &stride_grad, params[11] = &num_tokens, params[12] = &vocab;
      params[13] = &slice, params[14] = &ignore_index;
      for (int i = 0; i < 7; ++i) params[15 + i] = &scalars[i];
      params[22] = &grad_pred, params[23] = &flags, params[24] = &word_ptr, params[25] = &call_id;
      launch_or_throw("one-read", k.function, static_cast<unsigned>(t * k.cluster), k.threads, k.shared, stream,
                      params);
    }
    clock.mark(kOneRead);
    {
      const Arg args[] = {Arg::ptr(rows), Arg::ptr(weights_ptr), Arg::ptr(metrics.data_ptr()),
                          Arg::ptr(loss.data_ptr()), Arg::integer(t), Arg::f32(cfg.kl_coef)};
      launch_triton("weighted sums", sums->second, 1, stream, args, 6);
    }
    clock.mark(kSums);
    static const TritonKernel no_triton_kernel;  // the node launches the write kernel (write_)
    auto* grpo = attach_logits_node<GrpoLossBackward>(loss, logits, *call.ids, no_triton_kernel, call.temperature,
                                                     call.ignore_index, context);
    grpo->per_token_ = per_token;
    grpo->forward_grad_ = std::move(forward_grad);
    grpo->grad_pred_ = grad_pred;
    grpo->last_grad_ = err + kLastGrad * sizeof(int64_t);
    grpo->write_ = write->second;
    clock.mark(kNode);
    std::vector<at::Tensor> parts = at::unbind(metrics, 0);
    PyObject* dict = PyDict_New();
    if (dict == nullptr) return nullptr;
    for (int i = 0; i < 4; ++i) {
      PyObject* value = THPVariable_Wrap(std::move(parts[i]));
      if (value == nullptr || PyDict_SetItem(dict, metric_names[i], value) != 0) {
        Py_XDECREF(value);
        Py_DECREF(dict);
        return nullptr;
      }
      Py_DECREF(value);
    }
    PyObject* out = PyTuple_New(2);
    if (out == nullptr) {
      Py_DECREF(dict);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, 0, THPVariable_Wrap(std::move(loss)));
    PyTuple_SET_ITEM(out, 1, dict);
    served_calls.fetch_add(1, std::memory_order_relaxed);
    clock.mark(kOutputs);
    return out;
  } catch (const std::exception& exc) {  // an allocation that failed (out of memory), a launch, ...
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
}

// ---------------------------------------------------------------- registration

PyObject* register_forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes("register_forward", nargs, 5)) return nullptr;
  Call call;
  bool common;
  {
    c10::AutoGradMode enable(true);  // the Python path registers from inside autograd.Function.forward (no grad)
    common = common_case(args[0], &call);
  }
  if (!common) {
    PyErr_Clear();
    Py_RETURN_NONE;  // not a call the host path serves: nothing to store
  }
  if (!driver_or_error()) return nullptr;
  TritonKernel weights, sums;
  OneReadKernel one_read;
  unsigned long long one_read_function = 0, one_read_word = 0;
  long long cluster = 0, slice = 0;
  unsigned int threads = 0, shared = 0;
  if (!read_native(args[1], &weights) || !read_native(args[3], &sums) ||
      !PyArg_ParseTuple(args[2], "KLLII", &one_read_function, &cluster, &slice, &threads, &shared)) {
    return nullptr;
  }
  one_read_word = PyLong_AsUnsignedLongLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  one_read.function = one_read_function, one_read.cluster = cluster, one_read.slice = slice;
  one_read.threads = threads, one_read.shared = shared;
  if (cluster <= 0 || slice <= 0 || threads == 0) {
    PyErr_SetString(PyExc_ValueError, "grpo_loss host path: a one-read plan needs cluster, slice and threads > 0");
    return nullptr;
  }
  const int64_t t = call.t;
  const Arg weights_args[] = {Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}),
                              Arg::ptr(uint64_t{0}), Arg::integer(t), Arg::integer(call.samples),
                              Arg::kept(call.call_id)};
  const Arg sums_args[] = {Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}), Arg::ptr(uint64_t{0}),
                           Arg::ptr(uint64_t{0}), Arg::integer(t), Arg::f32(0.0)};
  if (!check_fits("token weights", weights, weights_args, 7) || !check_fits("weighted sums", sums, sums_args, 6)) {
    return nullptr;
  }
  if (!remember_context(call.device) || !remember_error_word(call.device, one_read_word)) return nullptr;
  const uint64_t one_read_at = one_read_key(call.device, call.logits->scalar_type(), call.v);
  const auto known = one_read_kernels.find(one_read_at);
  if (known != one_read_kernels.end()) {
    const OneReadKernel& old = known->second;
    if (old.function != one_read.function || old.cluster != one_read.cluster || old.slice != one_read.slice ||
        old.threads != one_read.threads || old.shared != one_read.shared) {
      Py_RETURN_FALSE;
    }
  }
  if (!store(weights_kernels, weights_key(call), weights) || !store(sums_kernels, sums_key(call), sums)) {
    Py_RETURN_FALSE;
  }
  one_read_kernels[one_read_at] = one_read;
  Py_RETURN_TRUE;
}

PyObject* register_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes("register_backward", nargs, 2)) return nullptr;
  if (!THPVariable_CheckExact(args[0])) Py_RETURN_NONE;
  const at::Tensor& logits = THPVariable_Unpack(args[0]);
  const int code = dtype_code(logits.scalar_type());
  if (logits.dim() != 2 || !logits.is_cuda() || code < 0 || code > 2 || logits.size(0) > kInt32Max ||
      logits.size(1) > kInt32Max) {
    Py_RETURN_NONE;
  }
  if (!driver_or_error()) return nullptr;
  WriteKernel kernel;
  unsigned long long function = 0;
  long long ctas = 0, blocks_per_row = 0, block_cols = 0;
  if (!PyArg_ParseTuple(args[1], "KLIILL", &function, &ctas, &kernel.threads, &kernel.shared, &blocks_per_row,
                        &block_cols)) {
    return nullptr;
  }
  if (ctas <= 0 || kernel.threads == 0 || blocks_per_row <= 0 || block_cols <= 0 || blocks_per_row > kInt32Max ||
      block_cols > kInt32Max) {
    PyErr_SetString(PyExc_ValueError, "grpo_loss host path: a write launch needs ctas, threads, blocks and columns > 0");
    return nullptr;
  }
  kernel.function = function, kernel.ctas = ctas;
  kernel.blocks_per_row = static_cast<int32_t>(blocks_per_row), kernel.block_cols = static_cast<int32_t>(block_cols);
  const int device = logits.get_device();
  if (!remember_context(device)) return nullptr;
  const uint64_t key = one_read_key(device, logits.scalar_type(), logits.size(1));
  const auto known = write_kernels.find(key);
  if (known != write_kernels.end()) {
    if (known->second == kernel) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
  }
  write_kernels.emplace(key, kernel);
  Py_RETURN_TRUE;
}

PyObject* configure(PyObject*, PyObject* args) {
  PyObject *names = nullptr, *fallback = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &names, &fallback)) return nullptr;
  if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != 4 || !PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_TypeError, "configure(metric_names: 4-tuple of str, second_backward: callable)");
    return nullptr;
  }
  for (int i = 0; i < 4; ++i) {
    PyObject* name = PyTuple_GET_ITEM(names, i);
    Py_INCREF(name);
    Py_XDECREF(metric_names[i]);
    metric_names[i] = name;
  }
  Py_INCREF(fallback);
  Py_XDECREF(second_backward);
  second_backward = fallback;
  Py_RETURN_NONE;
}

PyObject* clear(PyObject*, PyObject*) {
  weights_kernels.clear();
  sums_kernels.clear();
  write_kernels.clear();
  one_read_kernels.clear();
  Py_RETURN_NONE;
}

PyObject* phases(PyObject*, PyObject* on) {
  const int enable = PyObject_IsTrue(on);
  if (enable < 0) return nullptr;
  PyObject* out = PyDict_New();
  if (out == nullptr) return nullptr;
  for (int i = 0; i < kPhases; ++i) {
    const int64_t calls = phase_calls[i].exchange(0), ns = phase_ns[i].exchange(0);
    PyObject* value = PyFloat_FromDouble(calls ? static_cast<double>(ns) / calls / 1000.0 : 0.0);
    if (value == nullptr || PyDict_SetItemString(out, phase_names[i], value) != 0) {
      Py_XDECREF(value);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(value);
  }
  timing.store(enable != 0);
  return out;
}

PyMethodDef methods[] = {
    HOST_PATH_METHODS(
        "forward(call) -> (loss, metrics) | None (not the common case, or not registered)",
        "register_forward(call, weights_native, (one_read_function, cluster, slice, threads, shared), sums_native,"
        " error_word) -> True | False (a key holds another kernel) | None (not a common case)",
        "register_backward(logits, (write_function, ctas, threads, shared, blocks_per_row, block_cols))"
        " -> True | False | None"),
    {"configure", configure, METH_VARARGS, "configure(metric_names, second_backward)"},
    {"phases", phases, METH_O, "phases(on) -> {phase: mean us per call since the last phases() call}; on: keep timing"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "grpo_loss_one_read", "grpo_loss's host fast path", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_grpo_loss_one_read(void) { return PyModule_Create(&module); }
