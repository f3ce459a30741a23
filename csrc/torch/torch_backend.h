// Blocks as flat views of gradient buffers, reduced with c10d collectives.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <vector>

#include "../core/scheduler.h"

namespace dcredit {

// Launches a block as an all-reduce (sum) on the process group of its
// channel; completion comes back through the collective's future, so no
// thread of ours waits on the network. Every rank must give the same groups
// in the same order (Note [Same order on every rank]).
class TorchBackend : public Backend {
 public:
  explicit TorchBackend(std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups);

  // One flat view per block, cut from `buffers` by the plan; `postscale`
  // multiplies each reduced block (1/size for an average). Only between
  // iterations.
  void SetBlocks(const std::vector<at::Tensor>& buffers, const std::vector<BlockSpec>& blocks, double postscale);
  int32_t num_channels() const { return static_cast<int32_t>(groups_.size()); }

  void Launch(int32_t block, int32_t channel, Done done) override;

 private:
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_;
  std::vector<at::Tensor> views_;
  double postscale_ = 1.0;
};

}  // namespace dcredit
