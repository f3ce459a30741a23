// Compiled only in the CUDA build (setup.py). See Note [CUDA streams].
#include "cuda_sync.h"

// c10's CUDA headers and the runtime API only: ATen's CUDA context header
// would also need the cuBLAS/cuSPARSE/cuSOLVER headers, which a toolkit
// that has only nvcc and the runtime (such as this machine's) lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <utility>

namespace dcredit {
namespace {

// Runs on the driver's callback thread when the device reaches it. It must
// not call CUDA and must not throw into the driver.
void CUDART_CB RunDone(void* arg) {
  std::unique_ptr<Backend::Done> done(static_cast<Backend::Done*>(arg));
  try {
    (*done)(Status::Ok());
  } catch (...) {
    // Nothing to report to: the scheduler's timeout names the block.
  }
}

// A CUDA event, created on first record and without timing (cheaper to
// record and to wait on); callers hold a guard of the sync's device.
class Event {
 public:
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  ~Event() {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
  }

  void Record(cudaStream_t stream) {
    if (event_ == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  // `stream` waits, on the device, for the last Record; the host does not.
  void Block(cudaStream_t stream) const {
    if (event_ != nullptr) C10_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
  }

 private:
  cudaEvent_t event_ = nullptr;
};

// The launch stream (Note [CUDA streams], rule 2) is our own, not one of
// torch's pool streams: those are handed out round-robin, 32 per device, so a
// pool stream may also carry someone else's kernels (a user's side stream, a
// future callback's work), and every collective would then wait for them.
// Non-blocking, so that it does not synchronise with the legacy default
// stream either.
c10::cuda::CUDAStream CreateStream(c10::Device device) {
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return c10::cuda::getStreamFromExternal(stream, device.index());
}

class CudaSync : public DeviceSync {
 public:
  explicit CudaSync(c10::Device device) : device_(device), launch_stream_(CreateStream(device)) {}

  ~CudaSync() override {
    gate_.Close();
    // Work still queued on it (event waits) completes; the driver frees the
    // stream afterwards. At process exit the runtime may already be gone.
    (void)cudaStreamDestroy(launch_stream_.stream());
    (void)cudaGetLastError();
  }

  void Reset(int32_t num_tensors, const std::vector<std::vector<int32_t>>& block_tensors) override {
    gate_.Reset(block_tensors, num_tensors);
    std::lock_guard<std::mutex> lock(mu_);
    // At most one event per tensor, plus one for the flush.
    events_ = std::vector<Event>(static_cast<size_t>(num_tensors) + 1);
    slot_of_.assign(num_tensors, -1);
    next_slot_ = 0;
    final_events_ = std::vector<Event>(block_tensors.size());
  }

  void StartIteration() override {
    gate_.StartIteration();
    std::lock_guard<std::mutex> lock(mu_);
    std::fill(slot_of_.begin(), slot_of_.end(), -1);
    next_slot_ = 0;
  }

  void RecordReady(int32_t tensor) override {
    std::lock_guard<std::mutex> lock(mu_);
    // Out of range or twice: the scheduler's MarkReady, called next, says so.
    if (tensor < 0 || tensor >= static_cast<int32_t>(slot_of_.size()) || slot_of_[tensor] >= 0) return;
    c10::cuda::CUDAGuard guard(device_);
    const int32_t slot = next_slot_++;
    events_[slot].Record(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
    slot_of_[tensor] = slot;
  }

  void RecordRest() override {
    std::lock_guard<std::mutex> lock(mu_);
    c10::cuda::CUDAGuard guard(device_);
    int32_t slot = -1;
    for (int32_t& s : slot_of_) {
      if (s >= 0) continue;
      if (slot < 0) {
        slot = next_slot_++;
        events_[slot].Record(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
      }
      s = slot;
    }
  }

  c10::intrusive_ptr<c10d::Work> Launch(const std::vector<int32_t>& tensors, const Issue& issue) override {
    // Sets the device and this thread's current stream for the duration.
    c10::cuda::CUDAStreamGuard guard(launch_stream_);
    // No lock: a block is launched only after MarkReady for each of its
    // tensors returned, and MarkReady takes the scheduler's lock after the
    // record, so the slot and its event are already written. Waiting twice
    // on the same event (several blocks of one tensor) is harmless.
    for (int32_t t : tensors) {
      const int32_t slot = slot_of_[t];
      if (slot >= 0) events_[slot].Block(launch_stream_.stream());
    }
    // Note [Device windows]: behind the results of the blocks whose window slots this one takes. Later
    // launches wait for them too (the launch stream carries every wait): never wrong, at most stricter.
    for (int32_t b : next_behind_) final_events_[b].Block(launch_stream_.stream());
    next_behind_.clear();
    return issue();
  }

  bool BlockFinal(int32_t block) override { return gate_.IsBlockFinal(block); }

  void OrderNextAfter(const std::vector<int32_t>& blocks) override { next_behind_ = blocks; }

  void RecordFinal(int32_t block) override {
    if (block < 0 || block >= static_cast<int32_t>(final_events_.size())) return;
    c10::cuda::CUDAGuard guard(device_);
    // Only this block's callback records its event, once per iteration; the
    // gate's lock orders it before any wait on it.
    final_events_[block].Record(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
    gate_.MarkFinal(block);
  }

  void FailFinal() override { gate_.Fail(); }

  bool WaitFinalOnStream(const std::vector<int32_t>& tensors, std::chrono::milliseconds timeout) override {
    std::vector<int32_t> blocks;
    if (!gate_.WaitFinal(tensors, timeout, &blocks)) return false;
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
    for (int32_t b : blocks) final_events_[b].Block(stream);
    return true;
  }

  bool TensorFinal(int32_t tensor) override { return gate_.IsFinal(tensor); }

  void Close() override { gate_.Close(); }

  void NotifyWhenDone(Backend::Done done) override {
    c10::cuda::CUDAGuard guard(device_);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
    auto* arg = new Backend::Done(std::move(done));
    const cudaError_t err = cudaLaunchHostFunc(stream, &RunDone, arg);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear it, so that it is not reported by an unrelated call
      std::unique_ptr<Backend::Done> owned(arg);
      (*owned)(Status::Error(std::string("cudaLaunchHostFunc failed: ") + cudaGetErrorString(err)));
    }
  }

 private:
  const c10::Device device_;
  const c10::cuda::CUDAStream launch_stream_;
  std::mutex mu_;  // the marking threads (autograd's, the main one) among themselves
  std::vector<Event> events_;
  std::vector<int32_t> slot_of_;  // per tensor: its event this iteration, or -1
  int32_t next_slot_ = 0;
  // Note [Stream-ordered waits]: per block, the event after its result.
  std::vector<Event> final_events_;
  std::vector<int32_t> next_behind_;  // Note [Device windows]: dispatch thread only
  FinalGate gate_;
};

}  // namespace

std::shared_ptr<DeviceSync> MakeCudaSync(c10::Device device) {
  if (!device.is_cuda() || !device.has_index()) {
    throw std::invalid_argument("MakeCudaSync needs a CUDA device with an index, got " + device.str());
  }
  return std::make_shared<CudaSync>(device);
}

}  // namespace dcredit
