// What the host-path modules with a C++ autograd node share (grpo_loss_one_read.cpp,
// logp_single_device.cpp, ratio_kl_elementwise.cpp): inputs made fit for a backward kernel, the
// nodes of ops on logits (their saved logits and ids and the launch context, attached to an
// output), and an error raised in Python turned into one the engine reports. Apart from
// host_common.h so that a module without a node builds without torch's autograd headers.

#pragma once

#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "host_common.h"

namespace host_common {

inline void throw_python_error(const char* what) {
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  std::string message = what;
  if (value != nullptr) {
    PyObject* text = PyObject_Str(value);
    if (text != nullptr && PyUnicode_Check(text)) message += std::string(": ") + PyUnicode_AsUTF8(text);
    Py_XDECREF(text);
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  throw std::runtime_error(message);
}

// `x` itself if it is a contiguous, 16-byte aligned tensor of `dtype`, else such a copy of it (a
// backward kernel's specialization assumes aligned inputs; the values are the same).
inline at::Tensor fitting(const at::Tensor& x, at::ScalarType dtype) {
  if (x.scalar_type() == dtype && x.is_contiguous() && aligned(x.data_ptr())) return x;
  return at::empty(x.sizes(), x.options().dtype(dtype)).copy_(x);
}

// torch 2.11 holds nodes in std::shared_ptr, later versions in c10::intrusive_ptr: Edge says which.
using NodePtr = decltype(torch::autograd::Edge().function);

template <typename Ptr, typename N>
Ptr make_node() {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return Ptr(new N());
  } else {
    return c10::make_intrusive<N>();
  }
}

// The backward node of an op on logits: the logits and ids it reads are SavedVariables (saved-tensor
// hooks, the version-counter check, "backward through the graph a second time" after release), and
// its apply launches `kernel_` on `device_`'s current stream in the kernels' CUDA context.
struct LogitsBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable logits_, ids_;
  TritonKernel kernel_;
  double temperature_ = 1.0;
  int64_t ignore_index_ = 0;
  int device_ = 0;
  uint64_t context_ = 0;

  void release_variables() override {
    logits_.reset_data();
    ids_.reset_data();
  }
};

// A new N (a LogitsBackward) made `output`'s grad_fn, with `logits` the input it differentiates and
// what every such node keeps; returned for the op's own fields (`output` holds it).
template <typename N>
N* attach_logits_node(at::Tensor& output, const at::Tensor& logits, const at::Tensor& ids,
                      const TritonKernel& kernel, double temperature, int64_t ignore_index, uint64_t context) {
  auto node = make_node<NodePtr, N>();
  N* raw = static_cast<N*>(node.get());
  raw->set_next_edges(torch::autograd::collect_next_edges(logits));
  raw->logits_ = torch::autograd::SavedVariable(logits, false);
  raw->ids_ = torch::autograd::SavedVariable(ids, false);
  raw->kernel_ = kernel;
  raw->temperature_ = temperature;
  raw->ignore_index_ = ignore_index;
  raw->device_ = logits.get_device();
  raw->context_ = context;
  torch::autograd::create_gradient_edge(output, std::move(node));
  return raw;
}

}  // namespace host_common
