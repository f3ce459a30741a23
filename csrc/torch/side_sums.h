// Sums of small CPU tensors on the side group, started from C++ and waited
// for when their result is needed. See Note [Side sums].
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace dcredit {

// Note [Side sums]
// ~~~~~~~~~~~~~~~~
// Beside its blocks, the optimizer sums a few small CPU tensors over ranks on
// a Gloo group of its own, the side group: the tally, every iteration (Note
// [Global usage] in usage.py), and DeFT's delayed sum (Note [Delayed updates]
// in planner/deft.py). Start begins a sum on the calling thread (the training
// thread), in one c10d call from C++: no Python around it, and no thread of
// ours in between, so the order of the sums on the group is the order of the
// calls on every rank (a group pairs its collectives by their order), and
// anything else the training thread starts on that group (the embedding
// rows' all-gathers, a blocking sum) falls in that order too. The training
// thread waits for a sum (Wait) only when it needs the result, bounded by
// the timeout; no callback rides on the work's future.
// Measured on the 2-core machine (2026-12-06, benchmarks/results): a thread
// of ours that started the queued sums (the design before this one) cost
// GPT-shaped iterations 8-10% more than this with two wrapped models in one
// process, and the same within noise in host_cost (one wrapped model); the
// start itself costs the training thread 30-50 us in c10d and Gloo, on cold
// caches. On a host with idle cores that thread would take those
// microseconds off the training thread, at the price of a hand-over and of
// the drain that every other collective on the group waited for; not
// measured there yet. Starting the sums from Python cost more than either
// (pybind and c10d per call), and a completion callback on the work cost the
// next forward 0.1-0.25 ms.
class SideSums {
 public:
  explicit SideSums(c10::intrusive_ptr<c10d::ProcessGroup> group);
  ~SideSums();
  SideSums(const SideSums&) = delete;
  SideSums& operator=(const SideSums&) = delete;

  // Start an in-place sum of `tensor` (dense, contiguous, on the CPU) over
  // the group's ranks, now, on this thread; its ticket, for Wait. Throws
  // SchedulerError once closed, or with c10d's error where it cannot start.
  int64_t Start(at::Tensor tensor);
  // Until sum `ticket` is done. Throws SchedulerError: kTimeout after
  // `timeout` (the sum stays in flight: wait again), kError with the
  // collective's own error (the ticket is spent). A ticket already waited
  // for returns at once.
  void Wait(int64_t ticket, std::chrono::milliseconds timeout);
  // Refuses more sums and lets go of the group; sums in flight still finish,
  // and Wait still works for them. Idempotent.
  void Close();

 private:
  struct Entry {
    at::Tensor tensor;  // kept alive until the sum is waited for
    c10::intrusive_ptr<c10d::Work> work;
  };

  std::mutex mu_;  // held while a sum starts: starts from two threads still go in one order
  std::map<int64_t, Entry> entries_;  // started, not yet waited for
  int64_t next_ = 0;
  bool closed_ = false;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

}  // namespace dcredit
