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
// the timeout; no callback rides on the work's future. Measured on the 2-core
// machine, in one process taking turns (2026-12-06): a thread of ours that
// started the queued sums cost whole iterations 4-9% more than this
// (GPT-shaped and MLP models with SGD, a world of one), each hand-over
// waking one more thread; starting them from Python cost more than either
// (tens of microseconds of pybind and c10d per call), and a completion
// callback on the work cost the next forward 0.1-0.25 ms.
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
