// Backends with no network, for tests and for timing the scheduler alone.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <utility>
#include <vector>

#include "scheduler.h"

namespace dcredit {

// Completes every block inside Launch: measures the scheduler's own cost.
class NoopBackend : public Backend {
 public:
  void Launch(int32_t /*block*/, int32_t /*channel*/, Done done) override { done(Status::Ok()); }
};

// Holds every launch until someone completes it, in any order: tests drive
// it by hand, and backends whose collectives are only reachable from Python
// (Horovod, mpi4py) drive it from their own threads with NextLaunch/Complete.
class ManualBackend : public Backend {
 public:
  struct Launched {
    int32_t block;
    int32_t channel;
    std::vector<int32_t> behind;  // Note [Device windows]: the blocks it waits for "on the device"
  };

  void Launch(int32_t block, int32_t channel, Done done) override;
  // Note [Device windows], for tests: with `on`, a launch may be ordered behind any block launched before
  // it, as a CUDA device's is behind a block whose final event its launch recorded.
  void SetOrdersOnDevice(bool on);
  bool CanOrderAfter(int32_t block) override;
  void OrderNextAfter(const std::vector<int32_t>& blocks) override;
  // The next launch not yet taken, in launch order; false on timeout or
  // after Close(). For a driver thread that starts the real collective.
  bool NextLaunch(std::chrono::milliseconds timeout, Launched* out);
  // Wakes NextLaunch callers for good.
  void Close();
  // Launches not yet completed, in launch order.
  std::vector<Launched> Pending();
  // Every launch so far, in launch order.
  std::vector<Launched> History();
  // Completes a pending launch; returns false if `block` is not pending.
  bool Complete(int32_t block, Status status = Status::Ok());
  void Clear();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  bool orders_on_device_ = false;
  std::vector<int32_t> next_behind_;
  size_t taken_ = 0;  // launches handed out by NextLaunch
  std::vector<std::pair<Launched, Done>> pending_;
  std::vector<Launched> history_;
};

}  // namespace dcredit
