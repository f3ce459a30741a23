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
#include <memory>
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
// A sum's completion comes back through its work's future (where a work has
// none, the thread waits for it), and the training thread waits for a sum
// (Wait) only when it needs the result, bounded by a timeout. Whatever else
// the side group carries (the embedding rows' all-gathers, a blocking sum)
// the training thread starts itself after Drain: every queued sum started
// first, so the order on the group is still the order of the calls.
class SideSums {
 public:
  explicit SideSums(c10::intrusive_ptr<c10d::ProcessGroup> group);
  ~SideSums();
  SideSums(const SideSums&) = delete;
  SideSums& operator=(const SideSums&) = delete;

  // Queue an in-place sum of `tensor` (dense, on the CPU) over the group's
  // ranks; its ticket, for Wait. Throws SchedulerError once closed.
  int64_t Start(at::Tensor tensor);
  // Until sum `ticket` is done. Throws SchedulerError: kTimeout after
  // `timeout` (the sum stays in flight: wait again), kError with the
  // collective's own error. A ticket already waited for returns at once.
  void Wait(int64_t ticket, std::chrono::milliseconds timeout);
  // Until every queued sum has been started (not finished). Throws
  // SchedulerError (kTimeout) after `timeout`.
  void Drain(std::chrono::milliseconds timeout);
  // Starts what is queued, stops the thread and lets go of the group; sums in
  // flight still finish, and Wait still works for them. Idempotent.
  void Close();

 private:
  struct Entry {
    bool done = false;
    std::string error;
  };
  struct State {
    std::mutex mu;
    std::condition_variable changed;  // an entry done, or the queue drained: for the training thread
    std::condition_variable queued;   // work for the side thread
    std::deque<std::pair<int64_t, at::Tensor>> queue;
    std::map<int64_t, Entry> entries;  // started or queued, not yet waited for
    int64_t next = 0;
    bool starting = false;  // the side thread is starting one (popped, not yet handed to the group)
    bool stop = false;
  };
  void Loop();
  static void Finish(State& state, int64_t ticket, const std::string* error);

  std::shared_ptr<State> state_;  // shared with the futures' callbacks
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::thread thread_;
  std::mutex close_mu_;
};

}  // namespace dcredit
