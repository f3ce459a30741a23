// A reference model of the scheduler's rules, written from the notes in
// dcredit_opt/planner/plan.py (Note [Same order on every rank],
// Note [Credit window]) and Note [Group window] in planner/simulate.py,
// not from scheduler.cc, so that the tests compare two independent readings.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "../../csrc/core/scheduler.h"

namespace model {

using Rng = std::mt19937_64;

// What the plan alone decides: the launch sequence, and each block's group
// and window. Timing and event arrival order change none of it.
struct Reference {
  std::vector<int32_t> seq;     // block ids in launch order
  std::vector<int32_t> pos;     // per block: its index in `seq` (= launch number)
  std::vector<int32_t> window;  // per block
  std::vector<int32_t> group;   // per block
  // released_after[k]: how much of `seq` has been released once the first k
  // events (in plan order) are processed; k = 0..T. After the flush: all.
  std::vector<int32_t> released_after;
  std::vector<std::vector<int32_t>> tensor_blocks;  // blocks covering each tensor
};

Reference Expect(const dcredit::PlanSpec& plan);

// Replays launches for a given order of completions: the head of the
// sequence launches while fewer than its window are in flight and, with a
// byte credit, while the bytes fit (or nothing is in flight).
class Launcher {
 public:
  Launcher(const dcredit::PlanSpec& plan, const Reference& ref) : plan_(plan), ref_(ref) {}
  void ReleaseUpTo(int32_t n);  // `n` blocks of the sequence are released
  void Complete(int32_t block);
  const std::vector<int32_t>& in_flight() const { return in_flight_; }  // launch order
  int32_t launched() const { return next_; }

 private:
  bool CanLaunch(int32_t block) const;
  void Advance();

  const dcredit::PlanSpec& plan_;
  const Reference& ref_;
  int32_t released_ = 0;
  int32_t next_ = 0;
  std::vector<int32_t> in_flight_;
  int64_t bytes_ = 0;
};

// Limits for RandomPlan.
struct PlanShape {
  int32_t max_tensors = 8;
  int32_t max_blocks_per_tensor = 4;
  int32_t max_bytes = 1000;
  int32_t max_window = 4;
  int32_t max_channels = 4;
  bool merges = true;
};

// A random valid plan: sizes, priorities (with ties), windows including
// kReleaseAll and 0, phase-2 sizes, sometimes a byte credit, merges of
// neighbours in `order`; block ids in layout order, as plan.py numbers them.
dcredit::PlanSpec RandomPlan(Rng& rng, const PlanShape& shape);

// Checks one snapshot of the blocks in flight, in launch order. Taken after
// every completion, it sees each block with exactly the blocks that were in
// flight when it launched ahead of it (between two completions the set only
// grows), so index i must be below the block's window and, with a credit,
// the bytes ahead of it plus its own must fit unless it went alone.
void CheckInFlight(const dcredit::PlanSpec& plan, const Reference& ref, const std::vector<int32_t>& in_flight);

}  // namespace model
