#include "torch_backend.h"

#include "torch_compat.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

namespace dcredit {

// Note [Works without a future]
// A block's completion normally comes back through its collective's future,
// so no thread of ours waits on the network. Some works have no future:
// Gloo's reduce-scatter (Note [Two-stage blocks]) throws "Work::getFuture not
// implemented" in torch 2.13. Those go to one thread per backend that waits
// for them in launch order (Work::wait, bounded by the process group's
// timeout, which raises) and then completes them as the future would have.
// It starts at the first such work, drains what is queued when the backend
// goes, and never runs Python.
class WorkWaiter {
 public:
  using Finish = std::function<void(const std::string* error)>;

  ~WorkWaiter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

  void Push(c10::intrusive_ptr<c10d::Work> work, Finish finish) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
    queue_.emplace_back(std::move(work), std::move(finish));
    cv_.notify_one();
  }

 private:
  void Loop() {
    NameThisThread("dc_waiter");
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped, and nothing left to wait for
      auto [work, finish] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::string error;
      bool failed = false;
      try {
        work->wait();
      } catch (const std::exception& e) {
        error = e.what();
        failed = true;
      }
      finish(failed ? &error : nullptr);
      work.reset();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<c10::intrusive_ptr<c10d::Work>, Finish>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

TorchBackend::TorchBackend(std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups,
                           c10d::ReduceOp::RedOpType reduce)
    : groups_(std::move(groups)), reduce_(reduce) {
  if (groups_.empty()) throw std::invalid_argument("TorchBackend needs at least one process group");
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (!groups_[i]) throw std::invalid_argument("process group " + std::to_string(i) + " is None");
  }
}

TorchBackend::~TorchBackend() = default;  // joins the waiter, if one started

void TorchBackend::Close() {
  std::lock_guard<std::mutex> lock(close_mu_);
  waiter_.reset();  // drains what is queued (each wait bounded by its group's timeout), then joins
  groups_.clear();
  if (sync_) sync_->Close();
}

namespace {

// Elements [offset, offset + numel) of flat `buf` as a tensor with no view base.
// Not buf.narrow(): a view keeps its base, the buffer Python made, and the
// last reference to a block may be dropped by a Gloo worker thread (the last
// collective's work), which would then need the GIL to release the buffer's
// Python object; while the training thread, holding the GIL, destroys that
// process group and joins the worker: a deadlock. A tensor set on the same
// storage has no base and no Python object.
at::Tensor FlatRange(const at::Tensor& buf, int64_t offset, int64_t numel) {
  return at::empty({0}, buf.options()).set_(buf.storage(), buf.storage_offset() + offset, {numel}, {1});
}

}  // namespace

void TorchBackend::SetBlocks(const std::vector<at::Tensor>& buffers, const std::vector<at::Tensor>& wire_buffers,
                             const std::vector<BlockSpec>& blocks, int32_t num_tensors, double postscale) {
  // One device for everything: a block's collective, its event waits and
  // its completion all belong to the device of its buffer.
  const at::Device device = buffers.empty() ? at::Device(at::kCPU) : buffers[0].device();
  if (!device.is_cpu() && !device.is_cuda()) {
    throw std::invalid_argument("gradient buffers are on " + device.str() + "; blocks can live on the CPU or CUDA");
  }
  for (size_t i = 1; i < buffers.size(); ++i) {
    if (buffers[i].device() != device) {
      throw std::invalid_argument("buffer " + std::to_string(i) + " is on " + buffers[i].device().str() +
                                  " but buffer 0 is on " + device.str() + ": all blocks must be on one device");
    }
  }
  if (!wire_buffers.empty() && wire_buffers.size() != buffers.size()) {
    throw std::invalid_argument("wire_buffers: " + std::to_string(wire_buffers.size()) + " given for " +
                                std::to_string(buffers.size()) + " buffers");
  }
  for (size_t i = 0; i < wire_buffers.size(); ++i) {
    const at::Tensor& w = wire_buffers[i];
    if (w.numel() == 0) continue;
    if (w.device() != device || w.dim() != 1 || !w.is_contiguous() || w.numel() != buffers[i].numel()) {
      throw std::invalid_argument("wire buffer " + std::to_string(i) +
                                  " must be flat, contiguous, on the buffers' device and as long as buffer " +
                                  std::to_string(i));
    }
  }
  std::vector<at::Tensor> views;
  std::vector<at::Tensor> wires;
  std::vector<BlockOp> ops;
  std::vector<at::Tensor> shards(blocks.size()), padded(blocks.size());
  const int64_t world = groups_[0]->getSize();  // the constructor refuses an empty list
  std::vector<std::vector<int32_t>> block_tensors;
  views.reserve(blocks.size());
  block_tensors.reserve(blocks.size());
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
    const bool cast = !wire_buffers.empty() && wire_buffers[s.segment].numel() > 0;
    const at::Tensor& travels = cast ? wire_buffers[s.segment] : buf;
    if (s.bytes != s.numel * static_cast<int64_t>(travels.element_size())) {
      throw std::invalid_argument("block " + std::to_string(b) + " bytes do not match the dtype it travels in");
    }
    for (int32_t t : s.tensors) {
      if (t < 0 || t >= num_tensors) {
        throw std::invalid_argument("block " + std::to_string(b) + " covers tensor " + std::to_string(t) + " of " +
                                    std::to_string(num_tensors));
      }
    }
    views.push_back(FlatRange(buf, s.offset, s.numel));
    wires.push_back(cast ? FlatRange(travels, s.offset, s.numel) : at::Tensor());
    block_tensors.push_back(s.tensors);
    ops.push_back(s.op);
    if (s.op == BlockOp::kReduceScatter) {
      const int64_t shard = (s.numel + world - 1) / world;
      shards[b] = at::zeros({shard}, travels.options());
      if (shard * world != s.numel) padded[b] = at::zeros({shard * world}, travels.options());
    } else if (s.op == BlockOp::kAllGather) {  // ValidatePlan: `after` is its reduce-scatter, an earlier block
      shards[b] = shards[s.after];
      padded[b] = padded[s.after];
    }
  }
  std::shared_ptr<DeviceSync> sync;
  if (device.is_cuda()) {
    // Kept across plans on the same device, so its launch stream is too.
    sync = (sync_ && device_ == device) ? sync_ : MakeCudaSync(device);
    sync->Reset(num_tensors, block_tensors);
  }
  views_ = std::move(views);
  wires_ = std::move(wires);
  ops_ = std::move(ops);
  shards_ = std::move(shards);
  padded_ = std::move(padded);
  block_tensors_ = std::move(block_tensors);
  postscale_ = postscale;
  device_ = device;
  sync_ = std::move(sync);
}

bool TorchBackend::CanOrderAfter(int32_t block) { return sync_ && sync_->BlockFinal(block); }

void TorchBackend::OrderNextAfter(const std::vector<int32_t>& blocks) {
  if (sync_) sync_->OrderNextAfter(blocks);
}

void TorchBackend::RecordReady(int32_t tensor) {
  if (sync_) sync_->RecordReady(tensor);
}

void TorchBackend::RecordRest() {
  if (sync_) sync_->RecordRest();
}

void TorchBackend::StartIteration() {
  if (sync_) sync_->StartIteration();
}

bool TorchBackend::TensorFinal(int32_t tensor) {
  std::shared_ptr<DeviceSync> sync = sync_;
  return sync && sync->TensorFinal(tensor);
}

bool TorchBackend::WaitFinalOnStream(const std::vector<int32_t>& tensors, std::chrono::milliseconds timeout) {
  std::shared_ptr<DeviceSync> sync = sync_;
  return sync && sync->WaitFinalOnStream(tensors, timeout);
}

void TorchBackend::Launch(int32_t block, int32_t channel, Done done) {
  try {
    at::Tensor view = views_.at(block);
    at::Tensor wire = wires_.at(block);
    c10d::ProcessGroup& group = *groups_.at(channel);
    const BlockOp op = ops_.at(block);
    at::Tensor shard = shards_.at(block);
    at::Tensor padded = padded_.at(block);
    // Where the block travels: its wire view (Note [Wire dtype]) or itself.
    at::Tensor travels = wire.defined() ? wire : view;
    const c10d::ReduceOp::RedOpType reduce = reduce_;
    auto issue = [&group, &view, &wire, &travels, &shard, &padded, op, reduce]() -> c10::intrusive_ptr<c10d::Work> {
      // Collectives go on c10d's own stream, which waits for the current one
      // (Note [CUDA streams], rule 2): asyncOp. Recent c10d runs a synchronous
      // op on the current stream itself, where every channel would queue
      // behind the others.
      if (op == BlockOp::kAllGather) {  // Note [Two-stage blocks]: the reduced shards back into the block
        c10d::AllgatherOptions opts;
        opts.asyncOp = true;
        at::Tensor out = padded.defined() ? padded : travels;
        return compat::AllGatherSingle(group, out, shard, opts);
      }
      if (wire.defined()) wire.copy_(view);  // cast for the wire, on the stream the collective waits for
      if (op == BlockOp::kReduceScatter) {
        if (padded.defined()) padded.narrow(0, 0, travels.numel()).copy_(travels);  // the tail stays zero
        c10d::ReduceScatterOptions opts;
        opts.reduceOp = c10d::ReduceOp(reduce);
        opts.asyncOp = true;
        at::Tensor in = padded.defined() ? padded : travels;
        return compat::ReduceScatterSingle(group, shard, in, opts);
      }
      std::vector<at::Tensor> tensors{travels};
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp(reduce);
      opts.asyncOp = true;
      return group.allreduce(tensors, opts);
    };
    c10::intrusive_ptr<c10d::Work> work = sync_ ? sync_->Launch(block_tensors_[block], issue) : issue();
    const double post = postscale_;
    std::shared_ptr<DeviceSync> sync = sync_;
    // A reduce-scatter's shard stays as it is: the all-gather after it
    // finishes the block, as an all-reduce does (cast back, post-scale).
    // Runs when the collective completes: on the process group's thread for
    // Gloo on the CPU (or the waiter's, Note [Works without a future]); for a
    // CUDA future, inline here or on that thread, with a current stream that
    // waits for the collective (Note [CUDA streams]).
    WorkWaiter::Finish finish = [done, view, wire, travels, padded, post, sync, op,
                                 block](const std::string* error) mutable {
      if (error != nullptr) {
        if (sync) sync->FailFinal();
        done(Status::Error(*error));
        return;
      }
      try {
        if (op == BlockOp::kAllGather && padded.defined()) travels.copy_(padded.narrow(0, 0, travels.numel()));
        if (op != BlockOp::kReduceScatter && wire.defined()) view.copy_(wire);
        if (op != BlockOp::kReduceScatter && post != 1.0) view.mul_(post);
        if (sync) sync->RecordFinal(block);  // Note [Stream-ordered waits]
      } catch (const std::exception& e) {
        if (sync) sync->FailFinal();
        done(Status::Error(e.what()));
        return;
      }
      if (sync) {
        sync->NotifyWhenDone(std::move(done));
      } else {
        done(Status::Ok());
      }
    };
    c10::intrusive_ptr<c10::ivalue::Future> future;
    bool& futureless = futureless_[static_cast<size_t>(op)];
    if (!futureless) {
      try {
        future = work->getFuture();
      } catch (const c10::Error&) {  // Note [Works without a future]
        futureless = true;
      }
    }
    if (future) {
      future->addCallback([finish = std::move(finish)](c10::ivalue::Future& fut) mutable {
        if (fut.hasError()) {
          const std::string error = fut.tryRetrieveErrorMessage();
          finish(&error);
        } else {
          finish(nullptr);
        }
      });
    } else {
      if (!waiter_) waiter_ = std::make_unique<WorkWaiter>();
      waiter_->Push(std::move(work), std::move(finish));
    }
  } catch (const std::exception& e) {
    if (sync_) sync_->FailFinal();
    done(Status::Error(std::string("launch failed: ") + e.what()));
  }
}

}  // namespace dcredit
