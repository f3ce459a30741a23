// The few torch C++ APIs that were renamed inside the torch versions we build
// against. Our tested range starts at torch 2.13 (setup.py's TORCH_RANGE);
// CUDA machines often carry an older CUDA torch, and building there needs
// only these spellings, so the old ones stay here, in one place.
#pragma once

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/version.h>

namespace dcredit::compat {

#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
inline c10::intrusive_ptr<c10d::Work> AllGatherSingle(c10d::ProcessGroup& group, at::Tensor& out, at::Tensor& in,
                                                       const c10d::AllgatherOptions& opts) {
  return group._allgather_base(out, in, opts);
}
inline c10::intrusive_ptr<c10d::Work> ReduceScatterSingle(c10d::ProcessGroup& group, at::Tensor& out, at::Tensor& in,
                                                           const c10d::ReduceScatterOptions& opts) {
  return group._reduce_scatter_base(out, in, opts);
}
// Before 2.13 a leaf held its AccumulateGrad node through a std::weak_ptr.
inline void DropGradAccumulator(const at::Tensor& leaf) {
  torch::autograd::impl::set_grad_accumulator(leaf, std::weak_ptr<torch::autograd::Node>());
}
inline void RestoreGradAccumulator(const at::Tensor& leaf, const std::shared_ptr<torch::autograd::Node>& node) {
  torch::autograd::impl::set_grad_accumulator(leaf, std::weak_ptr<torch::autograd::Node>(node));
}
#else
inline c10::intrusive_ptr<c10d::Work> AllGatherSingle(c10d::ProcessGroup& group, at::Tensor& out, at::Tensor& in,
                                                       const c10d::AllgatherOptions& opts) {
  return group.all_gather_single(out, in, opts);
}
inline c10::intrusive_ptr<c10d::Work> ReduceScatterSingle(c10d::ProcessGroup& group, at::Tensor& out, at::Tensor& in,
                                                           const c10d::ReduceScatterOptions& opts) {
  return group.reduce_scatter_single(out, in, opts);
}
inline void DropGradAccumulator(const at::Tensor& leaf) {
  torch::autograd::impl::set_grad_accumulator(
      leaf, c10::weak_intrusive_ptr<torch::autograd::Node>(c10::intrusive_ptr<torch::autograd::Node>()));
}
inline void RestoreGradAccumulator(const at::Tensor& leaf, const c10::intrusive_ptr<torch::autograd::Node>& node) {
  torch::autograd::impl::set_grad_accumulator(leaf, c10::weak_intrusive_ptr<torch::autograd::Node>(node));
}
#endif

}  // namespace dcredit::compat
