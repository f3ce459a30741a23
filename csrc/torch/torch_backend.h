// Blocks as flat views of gradient buffers, reduced with c10d collectives.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <array>
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "../core/scheduler.h"
#include "cuda_sync.h"

namespace dcredit {

class WorkWaiter;  // Note [Works without a future], in torch_backend.cc

// Launches a block as an all-reduce on the process group of its channel
// (a sum, or the minimum, maximum or product: the optimizer's `op`); completion comes back through the collective's future, so no
// thread of ours waits on the network. Every rank must give the same groups
// in the same order (Note [Same order on every rank]). Blocks on a CUDA
// device are also ordered after their gradients' streams and reported done
// only once the device has finished them (Note [CUDA streams]).
class TorchBackend : public Backend {
 public:
  TorchBackend(std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups, c10d::ReduceOp::RedOpType reduce);
  ~TorchBackend() override;

  // One flat view per block, cut from `buffers` by the plan; `postscale`
  // multiplies each reduced block (1/size for an average). Every buffer must
  // be on the same device, the CPU or one CUDA device. `wire_buffers` is
  // empty, or one per buffer: an empty tensor (its blocks travel as they
  // are) or a flat tensor of the buffer's length in the dtype its blocks
  // travel in (Note [Wire dtype] in compression.py): a block is cast into
  // it at launch, reduced there, and cast back when done, then post-scaled.
  // A block's `bytes` count what travels. Only between iterations.
  void SetBlocks(const std::vector<at::Tensor>& buffers, const std::vector<at::Tensor>& wire_buffers,
                 const std::vector<BlockSpec>& blocks, int32_t num_tensors, double postscale);
  int32_t num_channels() const { return static_cast<int32_t>(groups_.size()); }

  // Gradient-ready on a CUDA device: `tensor`'s blocks wait for what the
  // calling thread's current stream has enqueued so far. No-op on the CPU.
  void RecordReady(int32_t tensor);
  // The same for every tensor not recorded this iteration (the flush).
  void RecordRest();
  void StartIteration();
  // Note [Stream-ordered waits]: on a CUDA device, waits until every block
  // of `tensors` has its result enqueued, then makes the calling thread's
  // current stream wait for them; true if it did. False on the CPU, or where
  // the scheduler's own wait must decide (a failed block, a closed backend).
  bool WaitFinalOnStream(const std::vector<int32_t>& tensors, std::chrono::milliseconds timeout);
  // Whether WaitFinalOnStream would return at once for `tensor` (false on the CPU).
  bool TensorFinal(int32_t tensor);

  void Launch(int32_t block, int32_t channel, Done done) override;
  // Note [Device windows]: on a CUDA device, a launch can wait there for a block whose final event is
  // recorded; on the CPU never.
  bool CanOrderAfter(int32_t block) override;
  void OrderNextAfter(const std::vector<int32_t>& blocks) override;

  // After the scheduler has shut down (its dispatch thread joined, so no
  // Launch runs again): join the waiter, if one started, and drop our
  // references to the process groups, so that destroying them on the Python
  // side really ends their threads now (Note [Orderly exit] in world/job.py)
  // rather than whenever this engine's Python object goes. Idempotent.
  void Close();

 private:
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_;
  c10d::ReduceOp::RedOpType reduce_;  // what a block's collective does to the ranks' values
  std::vector<at::Tensor> views_;
  std::vector<at::Tensor> wires_;  // per block: undefined, or where it travels (Note [Wire dtype])
  // Note [Two-stage blocks]: per block its collective; for a reduce-scatter and the all-gather after it, this
  // rank's reduced shard, and (when the block's length is not a multiple of the world size) a zero-padded copy
  // of the block that the two stages use in its place.
  std::vector<BlockOp> ops_;
  std::vector<at::Tensor> shards_;
  std::vector<at::Tensor> padded_;
  std::vector<std::vector<int32_t>> block_tensors_;
  double postscale_ = 1.0;
  at::Device device_{at::kCPU};  // where the buffers live
  // Null for CPU blocks. Shared with completion callbacks, which may run
  // after this backend is gone (a collective that outlives shutdown).
  std::shared_ptr<DeviceSync> sync_;
  // Per collective: whether its works lack a future (learned at the first launch), and the thread that
  // waits for such works; both used by the dispatch thread only (Launch).
  std::array<bool, 3> futureless_{};
  std::unique_ptr<WorkWaiter> waiter_;
  std::mutex close_mu_;  // Close() may come from two Python threads (a finalizer and shutdown())
};

}  // namespace dcredit
