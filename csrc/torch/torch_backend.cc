#include "torch_backend.h"

#include <stdexcept>
#include <string>

namespace dcredit {

TorchBackend::TorchBackend(std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups)
    : groups_(std::move(groups)) {
  if (groups_.empty()) throw std::invalid_argument("TorchBackend needs at least one process group");
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (!groups_[i]) throw std::invalid_argument("process group " + std::to_string(i) + " is None");
  }
}

void TorchBackend::SetBlocks(const std::vector<at::Tensor>& buffers, const std::vector<BlockSpec>& blocks,
                             double postscale) {
  std::vector<at::Tensor> views;
  views.reserve(blocks.size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    const BlockSpec& s = blocks[b];
    if (s.segment < 0 || s.segment >= static_cast<int32_t>(buffers.size())) {
      throw std::invalid_argument("block " + std::to_string(b) + " names buffer " + std::to_string(s.segment) +
                                  " of " + std::to_string(buffers.size()));
    }
    const at::Tensor& buf = buffers[s.segment];
    if (buf.dim() != 1 || !buf.is_contiguous()) {
      throw std::invalid_argument("buffer " + std::to_string(s.segment) + " must be flat and contiguous");
    }
    if (s.offset + s.numel > buf.numel()) {
      throw std::invalid_argument("block " + std::to_string(b) + " ends at element " +
                                  std::to_string(s.offset + s.numel) + " past buffer " +
                                  std::to_string(s.segment) + " of " + std::to_string(buf.numel()));
    }
    if (s.bytes != s.numel * static_cast<int64_t>(buf.element_size())) {
      throw std::invalid_argument("block " + std::to_string(b) + " bytes do not match its dtype");
    }
    views.push_back(buf.narrow(0, s.offset, s.numel));
  }
  views_ = std::move(views);
  postscale_ = postscale;
}

void TorchBackend::Launch(int32_t block, int32_t channel, Done done) {
  try {
    std::vector<at::Tensor> tensors{views_.at(block)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
    c10::intrusive_ptr<c10d::Work> work = groups_.at(channel)->allreduce(tensors, opts);
    at::Tensor view = views_[block];
    const double post = postscale_;
    // Runs on the process group's own thread when the collective ends.
    work->getFuture()->addCallback([done, view, post](c10::ivalue::Future& fut) mutable {
      if (fut.hasError()) {
        done(Status::Error(fut.tryRetrieveErrorMessage()));
        return;
      }
      try {
        if (post != 1.0) view.mul_(post);
      } catch (const std::exception& e) {
        done(Status::Error(e.what()));
        return;
      }
      done(Status::Ok());
    });
  } catch (const std::exception& e) {
    done(Status::Error(std::string("launch failed: ") + e.what()));
  }
}

}  // namespace dcredit
