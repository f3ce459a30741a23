// Which blocks have their final result enqueued on the device: the host side
// of a stream-ordered wait. See Note [Stream-ordered waits].
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "scheduler.h"

namespace dcredit {

// Note [Stream-ordered waits]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On a GPU, "the reduced block is in device memory" and "the host knows it"
// are different moments (Note [CUDA streams], rule 3): the scheduler counts a
// block done only when the device has finished it, so that the credit window
// limits what is queued on the device. A lazy update that waited for that
// (WaitTensor) would keep the host from queueing the next forward's kernels
// ahead of the device, as DDP's host does. So the update waits for less: its
// blocks' results being *enqueued*. When a block's collective completes on
// the host side (its future's callback), the callback enqueues the
// post-scale and then records a "final" event on that stream; MarkFinal says
// so here. The lazy step waits on the host only until every block of its
// tensors is final (WaitFinal: the collectives are launched; the credit
// window still decides when, so a block waiting for a slot waits for the
// device to finish an earlier one, and the host with it), then makes the
// current stream wait on those events (cudaStreamWaitEvent, which does not
// block the host) and enqueues the optimizer's kernels behind them. Whatever reads the updated parameter
// afterwards on that stream, or syncs with it, sees the reduced gradient's
// update; a host read (.item()) syncs with the stream.
//
// The gate is the state machine alone, with no CUDA in it, so that it is
// tested on any machine (tests/unit/test_final_gate.py); the CUDA adapter
// (cuda_sync.cc) owns the events. A failed block, or a closed gate, sends
// the waiter back to the scheduler's own wait, which reports the failure as
// the scheduler saw it. Iterations do not overlap: a new one starts (and
// clears the flags) only after every block of the last is done.
class FinalGate {
 public:
  // A new plan: `block_tensors[b]` are the tensors block b covers, each
  // < num_tensors (std::invalid_argument names the first that is not).
  void Reset(const std::vector<std::vector<int32_t>>& block_tensors, int32_t num_tensors) {
    std::vector<std::vector<int32_t>> tensor_blocks(static_cast<size_t>(num_tensors));
    for (size_t b = 0; b < block_tensors.size(); ++b) {
      for (int32_t t : block_tensors[b]) {
        if (t < 0 || t >= num_tensors) {
          throw std::invalid_argument("block " + std::to_string(b) + " covers tensor " + std::to_string(t) +
                                      " of " + std::to_string(num_tensors));
        }
        tensor_blocks[t].push_back(static_cast<int32_t>(b));
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    tensor_blocks_ = std::move(tensor_blocks);
    final_.assign(block_tensors.size(), 0);
    failed_ = false;
  }

  void StartIteration() {
    std::lock_guard<std::mutex> lock(mu_);
    std::fill(final_.begin(), final_.end(), 0);
    failed_ = false;
  }

  // Block `block`'s final event has been recorded (any thread).
  void MarkFinal(int32_t block) {
    std::lock_guard<std::mutex> lock(mu_);
    if (block < 0 || block >= static_cast<int32_t>(final_.size())) return;
    final_[block] = 1;
    cv_.notify_all();
  }

  // A block failed: every waiter goes back to the scheduler's wait.
  void Fail() {
    std::lock_guard<std::mutex> lock(mu_);
    failed_ = true;
    cv_.notify_all();
  }

  // The adapter is going away; idempotent.
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }

  // Whether every block covering `tensor` is final now (false for a tensor out of range, or after a failure).
  bool IsFinal(int32_t tensor) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_ || closed_ || tensor < 0 || tensor >= static_cast<int32_t>(tensor_blocks_.size())) return false;
    for (int32_t b : tensor_blocks_[tensor]) {
      if (!final_[b]) return false;
    }
    return true;
  }

  // Whether block `block`'s final event is recorded this iteration (Note [Device windows]).
  bool IsBlockFinal(int32_t block) {
    std::lock_guard<std::mutex> lock(mu_);
    return !failed_ && !closed_ && block >= 0 && block < static_cast<int32_t>(final_.size()) && final_[block];
  }

  // Waits until every block covering `tensors` is final and returns true with
  // those blocks in `blocks` (each once); false at once if a block failed or
  // the gate is closed. Throws SchedulerError (a timeout) naming the first
  // tensor still waiting after `timeout`, and std::out_of_range for a tensor
  // the plan does not have.
  bool WaitFinal(const std::vector<int32_t>& tensors, std::chrono::milliseconds timeout,
                 std::vector<int32_t>* blocks) {
    std::unique_lock<std::mutex> lock(mu_);
    for (int32_t t : tensors) {
      if (t < 0 || t >= static_cast<int32_t>(tensor_blocks_.size())) {
        throw std::out_of_range("final gate: tensor " + std::to_string(t) + " out of range");
      }
    }
    int32_t waiting = -1;
    auto all_final = [&] {
      for (int32_t t : tensors) {
        for (int32_t b : tensor_blocks_[t]) {
          if (!final_[b]) {
            waiting = t;
            return false;
          }
        }
      }
      return true;
    };
    const bool woke = cv_.wait_for(lock, timeout, [&] { return failed_ || closed_ || all_final(); });
    if (failed_ || closed_) return false;
    if (!woke) {
      throw SchedulerError(Status::Timeout("tensor " + std::to_string(waiting) + " not enqueued within " +
                                           std::to_string(timeout.count() / 1000.0) + " s"));
    }
    blocks->clear();
    std::vector<uint8_t> seen(final_.size(), 0);
    for (int32_t t : tensors) {
      for (int32_t b : tensor_blocks_[t]) {
        if (!seen[b]) {
          seen[b] = 1;
          blocks->push_back(b);
        }
      }
    }
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<int32_t>> tensor_blocks_;
  std::vector<uint8_t> final_;  // per block, this iteration
  bool failed_ = false;
  bool closed_ = false;
};

}  // namespace dcredit
