// Backends with no network, for tests and for timing the scheduler alone.
#pragma once

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

// Holds every launch until the test completes it, in any order it likes.
class ManualBackend : public Backend {
 public:
  struct Launched {
    int32_t block;
    int32_t channel;
  };

  void Launch(int32_t block, int32_t channel, Done done) override;
  // Launches not yet completed, in launch order.
  std::vector<Launched> Pending();
  // Every launch so far, in launch order.
  std::vector<Launched> History();
  // Completes a pending launch; returns false if `block` is not pending.
  bool Complete(int32_t block, Status status = Status::Ok());
  void Clear();

 private:
  std::mutex mu_;
  std::vector<std::pair<Launched, Done>> pending_;
  std::vector<Launched> history_;
};

}  // namespace dcredit
