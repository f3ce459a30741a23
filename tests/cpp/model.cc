#include "model.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <utility>

#include "check.h"

namespace model {

using dcredit::BlockSpec;
using dcredit::kReleaseAll;
using dcredit::PlanSpec;

Reference Expect(const PlanSpec& plan) {
  const int32_t T = plan.num_tensors;
  const int32_t B = static_cast<int32_t>(plan.blocks.size());
  Reference ref;
  ref.pos.assign(B, -1);
  ref.window.assign(B, 0);
  ref.group.assign(B, -1);
  ref.tensor_blocks.assign(T, {});
  std::vector<int32_t> missing(B);  // covered tensors whose event is not processed yet
  for (int32_t b = 0; b < B; ++b) {
    missing[b] = static_cast<int32_t>(plan.blocks[b].tensors.size());
    for (int32_t t : plan.blocks[b].tensors) ref.tensor_blocks[t].push_back(b);
  }
  // Ready blocks, best first: (priority, id); a std::set keeps it ordered.
  std::set<std::pair<int32_t, int32_t>> ready;
  int32_t groups = 0;
  auto release = [&](int32_t requested) {
    const int32_t have = static_cast<int32_t>(ready.size());
    const int32_t take = requested == kReleaseAll ? have : std::min(requested, have);
    if (take == 0) return;
    // Note [Group window]: a count keeps its value even if fewer blocks were
    // ready; ALL's window is the number of blocks it took.
    const int32_t window = requested == kReleaseAll ? take : requested;
    const int32_t group = groups++;
    for (int32_t i = 0; i < take; ++i) {
      const int32_t b = ready.begin()->second;
      ready.erase(ready.begin());
      ref.pos[b] = static_cast<int32_t>(ref.seq.size());
      ref.window[b] = window;
      ref.group[b] = group;
      ref.seq.push_back(b);
    }
  };
  ref.released_after.push_back(0);
  for (int32_t i = 0; i < T; ++i) {
    for (int32_t b : ref.tensor_blocks[plan.order[i]]) {
      if (--missing[b] == 0) ready.emplace(plan.blocks[b].priority, b);
    }
    release(plan.phase1_windows[i]);
    ref.released_after.push_back(static_cast<int32_t>(ref.seq.size()));
  }
  for (size_t g = 0; !ready.empty(); ++g) {
    release(plan.phase2_windows[std::min(g, plan.phase2_windows.size() - 1)]);
  }
  CHECK_EQ(static_cast<int32_t>(ref.seq.size()), B);
  return ref;
}

void Launcher::ReleaseUpTo(int32_t n) {
  released_ = std::max(released_, n);
  Advance();
}

void Launcher::Complete(int32_t block) {
  auto it = std::find(in_flight_.begin(), in_flight_.end(), block);
  CHECK_MSG(it != in_flight_.end(), "model: block " << block << " is not in flight");
  in_flight_.erase(it);
  bytes_ -= plan_.blocks[block].bytes;
  Advance();
}

bool Launcher::CanLaunch(int32_t block) const {
  const int32_t n = static_cast<int32_t>(in_flight_.size());
  if (n >= ref_.window[block]) return false;
  if (plan_.credit_bytes > 0 && n > 0 && bytes_ + plan_.blocks[block].bytes > plan_.credit_bytes) return false;
  return true;
}

void Launcher::Advance() {
  while (next_ < released_ && CanLaunch(ref_.seq[next_])) {
    const int32_t b = ref_.seq[next_++];
    in_flight_.push_back(b);
    bytes_ += plan_.blocks[b].bytes;
  }
}

PlanSpec RandomPlan(Rng& rng, const PlanShape& shape) {
  auto uniform = [&](int32_t lo, int32_t hi) { return std::uniform_int_distribution<int32_t>(lo, hi)(rng); };
  PlanSpec plan;
  const int32_t T = uniform(1, shape.max_tensors);
  plan.num_tensors = T;
  plan.order.resize(T);
  std::iota(plan.order.begin(), plan.order.end(), 0);
  std::shuffle(plan.order.begin(), plan.order.end(), rng);
  // Few distinct priorities, so that ties (broken by block id) are common.
  std::vector<int32_t> priority(T);
  for (int32_t& p : priority) p = uniform(0, 3);
  std::vector<int32_t> pieces(T);
  for (int32_t& k : pieces) k = uniform(1, shape.max_blocks_per_tensor);
  // Layout order: tensors in `order`, each cut into its pieces; a run of
  // one-piece neighbours may merge into a single block.
  int64_t offset = 0;
  for (int32_t i = 0; i < T;) {
    const int32_t t = plan.order[i];
    int32_t run = 1;
    if (shape.merges && pieces[t] == 1 && uniform(0, 3) == 0) {
      while (i + run < T && run < 3 && pieces[plan.order[i + run]] == 1) ++run;
    }
    if (run > 1) {
      BlockSpec b;
      b.priority = INT32_MAX;
      for (int32_t j = 0; j < run; ++j) {
        b.tensors.push_back(plan.order[i + j]);
        b.bytes += uniform(1, shape.max_bytes);
        b.priority = std::min(b.priority, priority[plan.order[i + j]]);
      }
      b.numel = b.bytes;
      b.offset = offset;
      offset += b.numel;
      plan.blocks.push_back(b);
      i += run;
      continue;
    }
    for (int32_t k = 0; k < pieces[t]; ++k) {
      BlockSpec b;
      b.tensors = {t};
      b.bytes = b.numel = uniform(1, shape.max_bytes);
      b.offset = offset;
      offset += b.numel;
      b.priority = priority[t];
      plan.blocks.push_back(b);
    }
    ++i;
  }
  for (int32_t i = 0; i < T; ++i) {
    const int32_t r = uniform(0, 5);
    plan.phase1_windows.push_back(r == 0 ? kReleaseAll : r == 1 ? 0 : uniform(1, shape.max_window));
  }
  const int32_t groups = uniform(1, 3);
  for (int32_t g = 0; g < groups; ++g) plan.phase2_windows.push_back(uniform(1, shape.max_window));
  // A credit around a few blocks' worth, sometimes below one block's size.
  plan.credit_bytes = uniform(0, 2) == 0 ? 0 : uniform(1, 3 * shape.max_bytes);
  plan.channels = uniform(1, shape.max_channels);
  dcredit::ValidatePlan(plan);
  return plan;
}

void CheckInFlight(const PlanSpec& plan, const Reference& ref, const std::vector<int32_t>& in_flight) {
  int64_t bytes = 0;
  for (size_t i = 0; i < in_flight.size(); ++i) {
    const int32_t b = in_flight[i];
    CHECK_MSG(static_cast<int32_t>(i) < ref.window[b],
              "block " << b << " launched with " << i << " in flight, window " << ref.window[b]);
    if (plan.credit_bytes > 0 && i > 0) {
      CHECK_MSG(bytes + plan.blocks[b].bytes <= plan.credit_bytes,
                "block " << b << " (" << plan.blocks[b].bytes << " bytes) launched with " << bytes
                         << " bytes in flight, credit " << plan.credit_bytes);
    }
    bytes += plan.blocks[b].bytes;
  }
}

}  // namespace model
