// Sums of small CPU tensors on the side group, started off the training
// thread. See Note [Side sums].
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace dcredit {

// Note [Side sums]
// ~~~~~~~~~~~~~~~~
// Beside its blocks, the optimizer sums a few small CPU tensors over ranks on
// a Gloo group of its own, the side group: the tally, every iteration (Note
// [Global usage] in usage.py), and DeFT's delayed sum (Note [Delayed updates]
// in planner/deft.py). Starting a collective costs tens of microseconds of
// c10d and Gloo, on cold caches, in the middle of an iteration. So the
// training thread only queues each sum (Start); one thread of ours
// (`dc_side`) starts them, in the order they were queued, which is the order
// of the calls on every rank (a group pairs its collectives by their order).
// The training thread waits for a sum (Wait) only when it needs the result:
// first until it is started, then on its work, each bounded by the timeout.
// No callback rides on the work's future: measured on the 2-core machine, a
// completion callback on this sum cost the next forward more (0.1-0.2 ms per
// iteration) than starting the sum on the training thread did.
// Whatever else the side group carries (the embedding rows' all-gathers, a
// blocking sum) the training thread starts itself after Drain: every queued
// sum started first, so the order on the group is still the order of the
// calls.
class SideSums {
 public:
  explicit SideSums(c10::intrusive_ptr<c10d::ProcessGroup> group);
  ~SideSums();
  SideSums(const SideSums&) = delete;
  SideSums& operator=(const SideSums&) = delete;

  // Queue an in-place sum of `tensor` (dense, contiguous, on the CPU) over
  // the group's ranks; its ticket, for Wait. Throws SchedulerError once closed.
  int64_t Start(at::Tensor tensor);
  // Until sum `ticket` is done. Throws SchedulerError: kTimeout after
  // `timeout` (the sum stays in flight: wait again), kError with the
  // collective's own error (the ticket is spent). A ticket already waited
  // for returns at once.
  void Wait(int64_t ticket, std::chrono::milliseconds timeout);
  // Until every queued sum has been started (not finished). Throws
  // SchedulerError (kTimeout) after `timeout`.
  void Drain(std::chrono::milliseconds timeout);
  // Starts what is queued, stops the thread and lets go of the group; sums in
  // flight still finish, and Wait still works for them. Idempotent.
  void Close();

 private:
  struct Entry {
    at::Tensor tensor;  // kept alive until the sum is waited for
    bool started = false;
    c10::intrusive_ptr<c10d::Work> work;  // once started, unless starting it failed
    std::string error;                    // why starting it failed
  };
  void Loop();

  std::mutex mu_;
  std::condition_variable changed_;  // a sum started, or the queue drained: for the training thread
  std::condition_variable queued_;   // work for the side thread
  std::deque<int64_t> queue_;
  std::map<int64_t, Entry> entries_;  // queued or started, not yet waited for
  int64_t next_ = 0;
  bool starting_ = false;  // the side thread is starting one (popped, not yet handed to the group)
  bool stop_ = false;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::thread thread_;
  std::mutex close_mu_;
};

}  // namespace dcredit
