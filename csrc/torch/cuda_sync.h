// Ordering a block's collective after the stream that produced its gradient,
// and learning when the device has finished it: the CUDA half of the torch
// adapter. This header is the one place where a CPU build and a CUDA build
// differ (setup.py defines DCREDIT_WITH_CUDA and compiles cuda_sync.cc only
// when the installed torch has CUDA); a CPU build compiles no CUDA code.
#pragma once

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../core/final_gate.h"
#include "../core/scheduler.h"

namespace dcredit {

// Note [CUDA streams]
// ~~~~~~~~~~~~~~~~~~~
// (What the lazy step waits for on the host is Note [Stream-ordered waits],
// in csrc/core/final_gate.h.)
// On a GPU, "the gradient is ready" (our hook ran on the host) and "the
// gradient is written" (the kernels that compute it have run) are different
// moments: the host enqueues work far ahead of the device. Three rules keep a
// collective from reading a block before backward has written it, without
// ever making the host wait for the compute stream.
//
// 1. Gradient-ready records an event. When a tensor is marked ready, an event
//    is recorded on the calling thread's *current* stream of the blocks'
//    device. The caller is the post-accumulate-grad hook, which autograd runs
//    with the stream of the node that accumulated the gradient as the current
//    stream, after our own copy of the gradient into its slot was enqueued
//    there; so the event covers exactly the producer of the gradient and the
//    copy, on whatever stream they ran (a user's side stream included). The
//    flush at step() records one event on the main thread's current stream
//    for every tensor not yet marked (parameters unused this iteration, whose
//    slots the flush has just filled there).
//
// 2. The collective is issued from a stream that waits on those events.
//    c10d's ProcessGroupNCCL (and Gloo's CUDA path) run the collective on an
//    internal stream that, at launch, waits for the *current* stream of the
//    launching thread. Our launching thread is the scheduler's dispatch
//    thread, and a thread's current stream is thread-local: left alone it is
//    the device's legacy default stream. That would be wrong both ways. The
//    pool streams torch computes on are created non-blocking, so a gradient
//    produced on a side stream would not be waited for at all (a race); and
//    a gradient produced on the default stream would be waited for together
//    with everything the host enqueued there after it, up to the moment of
//    launch (the rest of backward), so communication would trail compute
//    instead of overlapping it. Instead each launch runs under a guard that
//    makes a stream of our own ("launch stream", one per device) current on
//    the dispatch thread, after making it wait (cudaStreamWaitEvent, which
//    does not block the host) on the events of every tensor the block
//    covers. The launch stream carries nothing but these waits, so c10d's
//    stream, waiting on it, waits for exactly the gradients the block needs.
//    Several channels may all wait on the one launch stream without being
//    serialized by it: it holds no kernels.
//
// 3. Completion is learnt from the device, not from the future. For NCCL the
//    work's future is marked complete as soon as the collective is enqueued,
//    and its callbacks run at once, with a current stream that waits on the
//    collective's end. Treating that as completion would free the window's
//    slot while the collective is still running, so the credit window would
//    no longer limit what is queued on the device, and priorities could not
//    reorder anything. So the callback enqueues the postscale on that stream
//    and then a host function (cudaLaunchHostFunc) behind it; the driver
//    runs the host function when the device reaches it, and only then is the
//    block done. By then the reduced block is final in device memory, so
//    whoever waits on the scheduler (the lazy step) may use it from any
//    stream without further synchronisation. The host function only takes
//    the scheduler's lock and signals; it calls no CUDA API, as the driver
//    requires. The callback must not run under the launch-stream guard: if
//    the launch stream waited on a collective's end, the next collective on
//    every channel would wait for it too.
//
// Events and slots are reset per iteration; an iteration starts only after
// every block of the previous one is done on the device, so no launch still
// reads an event when it is re-recorded.

// What a device adds around one block's collective. TorchBackend holds one
// for CUDA blocks and none for CPU blocks, where the collective itself is
// the only order there is.
class DeviceSync {
 public:
  using Issue = std::function<c10::intrusive_ptr<c10d::Work>()>;

  virtual ~DeviceSync() = default;
  // A new plan: `block_tensors[b]` are the tensors block b covers; only
  // between iterations.
  virtual void Reset(int32_t num_tensors, const std::vector<std::vector<int32_t>>& block_tensors) = 0;
  // Forget the previous iteration's events.
  virtual void StartIteration() = 0;
  // The calling thread's current stream has enqueued everything that writes
  // `tensor`'s blocks. The first call per tensor and iteration counts.
  virtual void RecordReady(int32_t tensor) = 0;
  // The same, once, for every tensor not recorded yet (the flush).
  virtual void RecordRest() = 0;
  // Dispatch thread: calls `issue` with a current stream that waits for
  // every tensor in `tensors`; returns what `issue` returns.
  virtual c10::intrusive_ptr<c10d::Work> Launch(const std::vector<int32_t>& tensors, const Issue& issue) = 0;
  // In a completion callback: calls `done` once the device has finished
  // everything enqueued so far on the callback's current stream.
  virtual void NotifyWhenDone(Backend::Done done) = 0;
  // In a completion callback, after the block's last kernel (the post-scale)
  // was enqueued on the callback's current stream: records the block's final
  // event there (Note [Stream-ordered waits]).
  virtual void RecordFinal(int32_t block) = 0;
  // A block failed: stream-ordered waiters go back to the scheduler's wait.
  virtual void FailFinal() = 0;
  // Training thread: waits until every block of `tensors` has its final
  // event, then makes the calling thread's current stream wait on them and
  // returns true; false where the scheduler's own wait must decide (a block
  // failed, the adapter closed). Throws SchedulerError on timeout.
  virtual bool WaitFinalOnStream(const std::vector<int32_t>& tensors, std::chrono::milliseconds timeout) = 0;
  // Whether every block of `tensor` has its final event now (no wait).
  virtual bool TensorFinal(int32_t tensor) = 0;
  // Note [Device windows]: whether `block`'s final event is recorded, and the next Launch's wait for
  // those of `blocks` (dispatch thread only).
  virtual bool BlockFinal(int32_t block) = 0;
  virtual void OrderNextAfter(const std::vector<int32_t>& blocks) = 0;
  // The backend is closing: waiters return false. Idempotent.
  virtual void Close() = 0;
};

#ifdef DCREDIT_WITH_CUDA
constexpr bool kWithCuda = true;
// Defined in cuda_sync.cc.
std::shared_ptr<DeviceSync> MakeCudaSync(c10::Device device);
#else
constexpr bool kWithCuda = false;
inline std::shared_ptr<DeviceSync> MakeCudaSync(c10::Device device) {
  throw std::invalid_argument("gradient buffers are on " + device.str() +
                              ", but dcredit_opt._C was built without CUDA: install a CUDA build of torch and "
                              "the CUDA toolkit, then rebuild (pip install --no-build-isolation -e .)");
}
#endif

}  // namespace dcredit
