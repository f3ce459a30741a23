// The scheduler's invariants, driven one step at a time with ManualBackend.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "../../csrc/core/backends.h"
#include "../../csrc/core/scheduler.h"
#include "check.h"
#include "model.h"

namespace {

using namespace dcredit;
using model::Reference;
using model::Rng;
using ms = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// One block per tensor, `bytes[t]` bytes, priority `priority[t]`, order 0..T-1.
PlanSpec SimplePlan(const std::vector<int64_t>& bytes, const std::vector<int32_t>& priority,
                    std::vector<int32_t> phase1, std::vector<int32_t> phase2 = {1}) {
  PlanSpec plan;
  plan.num_tensors = static_cast<int32_t>(bytes.size());
  int64_t offset = 0;
  for (int32_t t = 0; t < plan.num_tensors; ++t) {
    plan.order.push_back(t);
    plan.blocks.push_back(BlockSpec{0, offset, bytes[t], bytes[t], priority[t], {t}});
    offset += bytes[t];
  }
  plan.phase1_windows = std::move(phase1);
  plan.phase2_windows = std::move(phase2);
  return plan;
}

std::vector<int32_t> Blocks(const std::vector<ManualBackend::Launched>& launched) {
  std::vector<int32_t> out;
  for (const auto& l : launched) out.push_back(l.block);
  return out;
}

std::string Str(const std::vector<int32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

// Waits until the backend holds exactly `expected` (launch order). The
// dispatch thread launches asynchronously, so intermediate snapshots may
// lack the newest launches; each one is still checked: nothing the model
// has not launched, channels by launch number, windows and credit.
void Sync(ManualBackend& m, const PlanSpec& plan, const Reference& ref, const std::vector<int32_t>& expected) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (true) {
    const auto pending = m.Pending();
    const std::vector<int32_t> blocks = Blocks(pending);
    for (const auto& l : pending) {
      CHECK_MSG(std::find(expected.begin(), expected.end(), l.block) != expected.end(),
                "block " << l.block << " launched; model expects in flight " << Str(expected));
      CHECK_EQ(l.channel, ref.pos[l.block] % plan.channels);
    }
    model::CheckInFlight(plan, ref, blocks);
    if (blocks == expected) return;
    CHECK_MSG(Clock::now() < deadline, "in flight " << Str(blocks) << ", model expects " << Str(expected));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Runs one iteration of `plan`: a random subset of gradients arrives in a
// random order (the flush supplies the rest), interleaved at random with
// completions in random order; after every step the launches must match the
// reference model, and at the end the history must be its sequence.
void Drive(Scheduler& s, ManualBackend& m, const PlanSpec& plan, const Reference& ref, Rng& rng) {
  const int32_t T = plan.num_tensors;
  const int32_t B = static_cast<int32_t>(plan.blocks.size());
  const size_t base = m.History().size();
  s.StartIteration();
  model::Launcher launcher(plan, ref);
  std::vector<int32_t> arrivals = plan.order;
  std::shuffle(arrivals.begin(), arrivals.end(), rng);
  if (rng() % 3 == 0) arrivals.resize(rng() % (T + 1));
  std::vector<char> arrived(T, 0);
  int32_t processed = 0;
  size_t next_arrival = 0;
  bool flushed = false;
  while (true) {
    Sync(m, plan, ref, launcher.in_flight());
    std::vector<int> options;  // 0: a gradient arrives, 1: a completion, 2: the flush
    if (next_arrival < arrivals.size()) options.push_back(0);
    if (!launcher.in_flight().empty()) options.push_back(1);
    if (next_arrival == arrivals.size() && !flushed) options.push_back(2);
    if (options.empty()) break;
    const int choice = options[rng() % options.size()];
    if (choice == 0) {
      const int32_t t = arrivals[next_arrival++];
      s.MarkReady(t);
      arrived[t] = 1;
      while (processed < T && arrived[plan.order[processed]]) ++processed;
      // Releases happen inside MarkReady: the trace shows them on return,
      // and an event that came early has released nothing yet.
      const std::vector<BlockTrace> trace = s.Trace();
      for (int32_t b = 0; b < B; ++b) {
        CHECK_EQ(trace[b].group >= 0, ref.pos[b] < ref.released_after[processed]);
      }
      launcher.ReleaseUpTo(ref.released_after[processed]);
    } else if (choice == 1) {
      const auto& in_flight = launcher.in_flight();
      const int32_t b = in_flight[rng() % in_flight.size()];
      CHECK(m.Complete(b));
      launcher.Complete(b);
    } else {
      s.Flush();
      flushed = true;
      launcher.ReleaseUpTo(B);
    }
  }
  CHECK_EQ(launcher.launched(), B);
  s.WaitAll(ms(5000));
  const auto history = m.History();
  CHECK_EQ(history.size() - base, static_cast<size_t>(B));
  for (int32_t i = 0; i < B; ++i) {
    CHECK_EQ(history[base + i].block, ref.seq[i]);
    CHECK_EQ(history[base + i].channel, i % plan.channels);
  }
  const std::vector<BlockTrace> trace = s.Trace();
  for (int32_t b = 0; b < B; ++b) {
    CHECK_EQ(trace[b].seq, static_cast<int64_t>(ref.pos[b]));
    CHECK_EQ(trace[b].window, ref.window[b]);
    CHECK_EQ(trace[b].group, ref.group[b]);
    CHECK(trace[b].launch_ns > 0 && trace[b].end_ns >= trace[b].launch_ns);
  }
  for (int32_t t = 0; t < T; ++t) CHECK(s.TensorDone(t));
}

TEST(ValidatePlanNamesTheBadField) {
  const PlanSpec good = SimplePlan({4, 4}, {0, 1}, {kReleaseAll, 0});
  ValidatePlan(good);
  struct Case {
    const char* field;
    void (*mutate)(PlanSpec&);
  };
  const Case cases[] = {
      {"num_tensors", [](PlanSpec& p) { p.num_tensors = -1; }},
      {"order", [](PlanSpec& p) { p.order.pop_back(); }},
      {"order", [](PlanSpec& p) { p.order = {1, 1}; }},
      {"phase1_windows", [](PlanSpec& p) { p.phase1_windows.pop_back(); }},
      {"phase1_windows", [](PlanSpec& p) { p.phase1_windows[0] = -2; }},
      {"phase2_windows", [](PlanSpec& p) { p.phase2_windows.clear(); }},
      {"phase2_windows", [](PlanSpec& p) { p.phase2_windows = {2, 0}; }},
      {"credit_bytes", [](PlanSpec& p) { p.credit_bytes = -1; }},
      {"channels", [](PlanSpec& p) { p.channels = 0; }},
      {"block 1", [](PlanSpec& p) { p.blocks[1].numel = 0; }},
      {"block 1", [](PlanSpec& p) { p.blocks[1].bytes = 0; }},
      {"block 0", [](PlanSpec& p) { p.blocks[0].offset = -1; }},
      {"block 0 covers no tensor", [](PlanSpec& p) { p.blocks[0].tensors.clear(); }},
      {"block 1 covers a tensor out of range", [](PlanSpec& p) { p.blocks[1].tensors = {2}; }},
  };
  ManualBackend backend;
  Scheduler s(&backend, ms(5000));
  for (const Case& c : cases) {
    PlanSpec bad = good;
    c.mutate(bad);
    CHECK_THROWS(ValidatePlan(bad), std::invalid_argument, c.field);
    CHECK_THROWS(s.SetPlan(bad), std::invalid_argument, c.field);
  }
}

TEST(RandomPlansFollowTheReferenceModel) {
  Rng rng(check::Opts().seed);
  ManualBackend backend;
  Scheduler s(&backend, ms(10000));
  for (int plan_no = 0; plan_no < 300; ++plan_no) {
    const PlanSpec plan = model::RandomPlan(rng, model::PlanShape{});
    const Reference ref = model::Expect(plan);
    s.SetPlan(plan);
    // Two iterations with other arrival and completion orders: the same
    // launch sequence (Note [Same order on every rank]).
    Drive(s, backend, plan, ref, rng);
    Drive(s, backend, plan, ref, rng);
  }
  CHECK(s.status().ok());
}

TEST(PriorityOrderAmongBlocksReleasedTogether) {
  // Events 0-2 hold (window 0); event 3 releases all four at once: by
  // priority, ties by block id.
  ManualBackend m;
  Scheduler s(&m, ms(5000));
  s.SetPlan(SimplePlan({1, 1, 1, 1}, {2, 0, 1, 0}, {0, 0, 0, kReleaseAll}));
  s.StartIteration();
  for (int32_t t = 0; t < 4; ++t) s.MarkReady(t);
  s.Flush();
  for (int32_t b : {1, 3, 2, 0}) {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (!m.Complete(b)) {
      CHECK_MSG(Clock::now() < deadline, "block " << b << " never launched; in flight " << Str(Blocks(m.Pending())));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  s.WaitAll(ms(5000));
  CHECK_EQ(Str(Blocks(m.History())), std::string("[1,3,2,0]"));
}

TEST(LaterHigherPriorityOvertakesHeldBlocks) {
  // Tensor 0 (priority 1) has blocks 0-2; event 0 releases one of them and
  // holds two. Tensor 1's block 3 (priority 0) arrives next and goes before
  // the held ones; the flush releases those last.
  PlanSpec plan;
  plan.num_tensors = 2;
  plan.order = {0, 1};
  for (int32_t k = 0; k < 3; ++k) plan.blocks.push_back(BlockSpec{0, k * 8, 8, 8, 1, {0}});
  plan.blocks.push_back(BlockSpec{0, 24, 8, 8, 0, {1}});
  plan.phase1_windows = {1, 1};
  plan.phase2_windows = {1};
  ManualBackend m;
  Scheduler s(&m, ms(5000));
  s.SetPlan(plan);
  Rng rng(check::Opts().seed);
  Drive(s, m, plan, model::Expect(plan), rng);
  CHECK_EQ(Str(Blocks(m.History())), std::string("[0,3,1,2]"));
}

TEST(EarlyEventIsBufferedUntilItsTurn) {
  ManualBackend m;
  Scheduler s(&m, ms(5000));
  s.SetPlan(SimplePlan({1, 1, 1}, {0, 1, 2}, {kReleaseAll, kReleaseAll, kReleaseAll}));
  s.StartIteration();
  s.MarkReady(2);  // expected last: waits for events 0 and 1
  s.MarkReady(1);
  for (const BlockTrace& t : s.Trace()) CHECK_EQ(t.group, -1);
  std::this_thread::sleep_for(ms(20));
  CHECK(m.Pending().empty());
  s.MarkReady(0);  // processes events 0, 1, 2 in plan order
  const auto trace = s.Trace();
  for (int32_t b = 0; b < 3; ++b) CHECK_EQ(trace[b].group, b);
  for (int32_t b = 0; b < 3; ++b) {
    while (!m.Complete(b)) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  s.WaitAll(ms(5000));
  CHECK_EQ(Str(Blocks(m.History())), std::string("[0,1,2]"));
}

TEST(CreditBytesLetAnOversizedBlockGoOnlyAlone) {
  // Credit 100 bytes; window ALL at the single event (all five in one group).
  PlanSpec plan;
  plan.num_tensors = 1;
  plan.order = {0};
  int64_t offset = 0;
  for (int64_t bytes : {60, 60, 30, 250, 10}) {
    plan.blocks.push_back(BlockSpec{0, offset, bytes, bytes, 0, {0}});
    offset += bytes;
  }
  plan.phase1_windows = {kReleaseAll};
  plan.phase2_windows = {1};
  plan.credit_bytes = 100;
  const Reference ref = model::Expect(plan);
  ManualBackend m;
  Scheduler s(&m, ms(5000));
  s.SetPlan(plan);
  s.StartIteration();
  s.MarkReady(0);
  Sync(m, plan, ref, {0});  // 60 + 60 > 100: block 1 waits
  CHECK(m.Complete(0));
  Sync(m, plan, ref, {1, 2});  // 60 + 30 fit
  CHECK(m.Complete(1));
  Sync(m, plan, ref, {2});  // 250 waits for an empty pipe
  CHECK(m.Complete(2));
  Sync(m, plan, ref, {3});  // alone, overdrawing; 10 more would not fit
  CHECK(m.Complete(3));
  Sync(m, plan, ref, {4});
  CHECK(m.Complete(4));
  s.WaitAll(ms(5000));
}

TEST(ChannelIsLaunchNumberModuloChannels) {
  PlanSpec plan = SimplePlan({1, 1, 1, 1, 1, 1, 1}, {0, 0, 0, 0, 0, 0, 0}, std::vector<int32_t>(7, kReleaseAll));
  plan.channels = 3;
  ManualBackend m;
  Scheduler s(&m, ms(5000));
  s.SetPlan(plan);
  Rng rng(check::Opts().seed + 1);
  for (int iteration = 0; iteration < 3; ++iteration) Drive(s, m, plan, model::Expect(plan), rng);
  const auto history = m.History();
  for (size_t i = 0; i < history.size(); ++i) CHECK_EQ(history[i].channel, static_cast<int32_t>(i % 7 % 3));
}

TEST(FailedCompletionNamesTheBlockAndItsTensors) {
  PlanSpec plan;
  plan.num_tensors = 3;
  plan.order = {0, 1, 2};
  plan.blocks = {BlockSpec{0, 0, 4, 16, 0, {0}}, BlockSpec{0, 4, 8, 32, 1, {1, 2}}};
  plan.phase1_windows = {kReleaseAll, kReleaseAll, kReleaseAll};
  plan.phase2_windows = {1};
  ManualBackend m;
  Scheduler s(&m, ms(5000));
  s.SetPlan(plan);
  s.StartIteration();
  s.Flush();
  while (!m.Complete(0)) std::this_thread::sleep_for(std::chrono::microseconds(20));
  while (!m.Complete(1, Status::Error("boom"))) std::this_thread::sleep_for(std::chrono::microseconds(20));
  CHECK_THROWS(s.WaitAll(ms(5000)), SchedulerError, "block 1 (tensors 1,2");
  try {
    s.WaitTensor(2, ms(5000));
    CHECK_MSG(false, "WaitTensor returned after a failure");
  } catch (const SchedulerError& e) {
    CHECK(e.status.code == StatusCode::kError);
    CHECK(std::string(e.what()).find("boom") != std::string::npos);
  }
  CHECK_THROWS(s.StartIteration(), SchedulerError, "boom");  // the error is sticky
}

TEST(TimeoutNamesTheBlockThatHung) {
  ManualBackend m;
  Scheduler s(&m, ms(50));
  s.SetPlan(SimplePlan({4, 4}, {0, 1}, {kReleaseAll, kReleaseAll}));
  s.StartIteration();
  s.Flush();
  while (!m.Complete(0)) std::this_thread::sleep_for(std::chrono::microseconds(20));
  const auto start = Clock::now();
  try {
    s.WaitAll(ms(10000));
    CHECK_MSG(false, "WaitAll returned with block 1 never completed");
  } catch (const SchedulerError& e) {
    CHECK(e.status.code == StatusCode::kTimeout);
    CHECK_MSG(std::string(e.what()).find("block 1 (tensors 1") != std::string::npos, e.what());
  }
  CHECK(Clock::now() - start < std::chrono::seconds(5));  // the scheduler's 50 ms, not the wait's 10 s
}

TEST(ShutdownFailsPendingWaitsWithoutHanging) {
  ManualBackend m;
  auto s = std::make_unique<Scheduler>(&m, ms(30000));
  s->SetPlan(SimplePlan({4, 4}, {0, 1}, {kReleaseAll, kReleaseAll}));
  s->StartIteration();
  s->Flush();
  std::atomic<int> failed{0};
  std::vector<std::thread> waiters;
  waiters.emplace_back([&] {
    try {
      s->WaitAll(ms(30000));
    } catch (const SchedulerError& e) {
      if (e.status.code == StatusCode::kShutdown) ++failed;
    }
  });
  waiters.emplace_back([&] {
    try {
      s->WaitTensor(1, ms(30000));
    } catch (const SchedulerError& e) {
      if (e.status.code == StatusCode::kShutdown) ++failed;
    }
  });
  while (m.Pending().empty()) std::this_thread::sleep_for(std::chrono::microseconds(20));
  std::this_thread::sleep_for(ms(20));  // let the waiters block
  const auto start = Clock::now();
  s->Shutdown();
  for (auto& w : waiters) w.join();
  CHECK(Clock::now() - start < std::chrono::seconds(5));
  CHECK_EQ(failed.load(), 2);
  CHECK_THROWS(s->WaitAll(ms(1000)), SchedulerError, "shut down");
  CHECK_THROWS(s->StartIteration(), SchedulerError, "shut down");
  s->Shutdown();  // idempotent
  s.reset();
  // A collective the backend could not cancel completes after the
  // scheduler is gone: the callback must find live memory (ASan checks).
  CHECK(m.Complete(0));
}

// Note [Interrupted backward] (dcredit_opt/optimizer/core.py): a backward stopped before its flush leaves the
// blocks it released in flight; WaitReleased waits for those (one at a time here), never for the unreleased.
TEST(WaitReleasedFinishesWhatAnInterruptedBackwardReleased) {
  ManualBackend m;
  Scheduler s(&m, ms(30000));
  s.SetPlan(SimplePlan({4, 4, 4}, {0, 1, 2}, {1, 1, 1}));
  s.WaitReleased(ms(1000));  // no iteration: nothing in flight
  s.StartIteration();
  s.MarkReady(1);  // before its turn: buffered, nothing released
  s.WaitReleased(ms(1000));
  s.MarkReady(0);  // blocks 0 and 1 released, 1 queued behind 0; tensor 2 never comes
  CHECK_THROWS(s.WaitReleased(ms(100)), SchedulerError, "1 queued, 1 in flight");
  std::atomic<bool> done{false};
  std::thread waiter([&] {
    s.WaitReleased(ms(30000));
    done = true;
  });
  while (!m.Complete(0)) std::this_thread::sleep_for(std::chrono::microseconds(20));
  std::this_thread::sleep_for(ms(20));
  CHECK_MSG(!done.load(), "WaitReleased returned with block 1 still to launch");
  while (!m.Complete(1)) std::this_thread::sleep_for(std::chrono::microseconds(20));
  waiter.join();
  CHECK(!s.TensorDone(2));
  CHECK_EQ(Str(Blocks(m.History())), std::string("[0,1]"));
  CHECK_THROWS(s.WaitAll(ms(100)), SchedulerError, "iteration not reduced");
  s.Shutdown();
  s.WaitReleased(ms(1000));  // nothing in flight: returns even after the shutdown
}

TEST(MisuseIsRejected) {
  ManualBackend m;
  Scheduler s(&m, ms(5000));
  s.SetPlan(SimplePlan({4, 4}, {0, 1}, {kReleaseAll, kReleaseAll}));
  CHECK_THROWS(s.MarkReady(0), std::logic_error, "before StartIteration");
  s.StartIteration();
  CHECK_THROWS(s.MarkReady(2), std::out_of_range, "tensor 2");
  s.MarkReady(0);
  CHECK_THROWS(s.MarkReady(0), std::logic_error, "tensor 0 marked ready twice");
  CHECK_THROWS(s.StartIteration(), std::logic_error, "pending");
  CHECK_THROWS(s.SetPlan(SimplePlan({4}, {0}, {kReleaseAll})), std::logic_error, "pending");
  s.Flush();
  s.Flush();  // idempotent within an iteration
  for (int32_t b = 0; b < 2; ++b) {
    while (!m.Complete(b)) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  s.WaitAll(ms(5000));
  s.StartIteration();  // fine once everything is done
  CHECK(!s.TensorDone(0));
  s.Flush();
  for (int32_t b = 0; b < 2; ++b) {
    while (!m.Complete(b)) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  s.WaitTensor(0, ms(5000));
  s.WaitAll(ms(5000));
  CHECK(s.status().ok());
}

// Note [Two-stage blocks]: tensor t in forward order has a first stage (block 2t) and a second (2t + 1,
// after 2t, held until the flush), both of priority t; gradients become ready in reverse (backward).
PlanSpec TwoStagePlan(int32_t T, int32_t phase2_window) {
  PlanSpec plan;
  plan.num_tensors = T;
  for (int32_t t = T - 1; t >= 0; --t) plan.order.push_back(t);
  for (int32_t t = 0; t < T; ++t) {
    BlockSpec first{0, 8 * t, 8, 32, t, {t}};
    first.op = BlockOp::kReduceScatter;
    BlockSpec second = first;
    second.op = BlockOp::kAllGather;
    second.after = 2 * t;
    second.at_flush = true;
    plan.blocks.push_back(first);
    plan.blocks.push_back(second);
  }
  plan.phase1_windows.assign(T, kReleaseAll);
  plan.phase2_windows = {phase2_window};
  plan.channels = 2;
  return plan;
}

void CompleteWhenLaunched(ManualBackend& m, int32_t b) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!m.Complete(b)) {
    CHECK_MSG(Clock::now() < deadline, "block " << b << " never launched; in flight " << Str(Blocks(m.Pending())));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

TEST(SecondStageWaitsForTheFlushAndForItsFirstStage) {
  ManualBackend m;
  Scheduler s(&m, ms(5000));
  s.SetPlan(TwoStagePlan(2, 2));
  s.StartIteration();
  s.MarkReady(1);  // backward: tensor 1 first; only its first stage goes
  s.MarkReady(0);
  CompleteWhenLaunched(m, 2);
  CompleteWhenLaunched(m, 0);
  std::this_thread::sleep_for(ms(20));
  CHECK_MSG(m.Pending().empty(), "a second stage launched before the flush: " << Str(Blocks(m.Pending())));
  s.Flush();  // both second stages released, forward order
  CompleteWhenLaunched(m, 1);
  CompleteWhenLaunched(m, 3);
  s.WaitAll(ms(5000));
  CHECK_EQ(Str(Blocks(m.History())), std::string("[2,0,1,3]"));

  // Flushed while both first stages are still in flight: the head of the sequence (block 1) waits for block 0,
  // and block 3 waits behind it even though its own first stage finishes first.
  s.StartIteration();
  s.MarkReady(1);
  s.MarkReady(0);
  s.Flush();
  CompleteWhenLaunched(m, 2);
  std::this_thread::sleep_for(ms(20));
  CHECK_EQ(Str(Blocks(m.Pending())), std::string("[0]"));
  CompleteWhenLaunched(m, 0);
  CompleteWhenLaunched(m, 1);
  CompleteWhenLaunched(m, 3);
  s.WaitAll(ms(5000));
  const auto history = Blocks(m.History());
  CHECK_EQ(Str(std::vector<int32_t>(history.begin() + 4, history.end())), std::string("[2,0,1,3]"));
}

TEST(TwoStageSequenceIsTheSameWhateverTheCompletionOrder) {
  // Random arrival and completion orders (as on ranks with different timing): the launch sequence must not
  // change, and no second stage may start before its first has finished.
  const int32_t T = 7;
  const PlanSpec plan = TwoStagePlan(T, 3);
  std::vector<int32_t> expected;
  for (int32_t t = T - 1; t >= 0; --t) expected.push_back(2 * t);  // first stages, in ready order
  for (int32_t t = 0; t < T; ++t) expected.push_back(2 * t + 1);   // second stages, in forward order
  Rng rng(check::Opts().seed);
  for (int round = 0; round < 30; ++round) {
    ManualBackend m;
    Scheduler s(&m, ms(5000));
    s.SetPlan(plan);
    s.StartIteration();
    std::vector<int32_t> arrivals = plan.order;
    std::shuffle(arrivals.begin(), arrivals.end(), rng);
    arrivals.resize(rng() % (T + 1));  // the flush supplies the rest
    size_t next = 0;
    bool flushed = false;
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (m.History().size() < expected.size() || !m.Pending().empty()) {
      CHECK_MSG(Clock::now() < deadline, "round " << round << ": stuck with " << Str(Blocks(m.History()))
                                                  << " launched, " << Str(Blocks(m.Pending())) << " in flight");
      const auto pending = m.Pending();
      const int choice = static_cast<int>(rng() % 3);
      if (choice == 0 && next < arrivals.size()) {
        s.MarkReady(arrivals[next++]);
      } else if (choice == 1 && !pending.empty()) {
        CHECK(m.Complete(pending[rng() % pending.size()].block));
      } else if (next == arrivals.size() && !flushed) {
        s.Flush();
        flushed = true;
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    s.WaitAll(ms(5000));
    CHECK_EQ(Str(Blocks(m.History())), Str(expected));
    const auto trace = s.Trace();
    for (int32_t t = 0; t < T; ++t) {
      CHECK_MSG(trace[2 * t + 1].launch_ns >= trace[2 * t].end_ns,
                "round " << round << ": block " << 2 * t + 1 << " launched before block " << 2 * t << " finished");
    }
  }
}

TEST(TwoStagePlansAreValidated) {
  auto with = [](auto change) {
    PlanSpec plan = TwoStagePlan(2, 1);
    change(plan);
    return plan;
  };
  ValidatePlan(TwoStagePlan(3, 2));
  CHECK_THROWS(ValidatePlan(with([](PlanSpec& p) { p.blocks[1].after = 1; })), std::invalid_argument,
               "'after' must be an earlier block");
  CHECK_THROWS(ValidatePlan(with([](PlanSpec& p) { p.blocks[3].after = 0; })), std::invalid_argument,
               "covers other tensors");
  CHECK_THROWS(ValidatePlan(with([](PlanSpec& p) { p.blocks[0].priority = 5; })), std::invalid_argument,
               "lower priority");
  CHECK_THROWS(ValidatePlan(with([](PlanSpec& p) { p.blocks[1].at_flush = false, p.blocks[0].at_flush = true; })),
               std::invalid_argument, "held until the flush");
  CHECK_THROWS(ValidatePlan(with([](PlanSpec& p) { p.blocks[0].op = static_cast<BlockOp>(7); })),
               std::invalid_argument, "has op 7");
  CHECK_THROWS(ValidatePlan(with([](PlanSpec& p) { p.blocks[1].op = BlockOp::kAllReduce; })), std::invalid_argument,
               "reduce-scatter with 0 all-gathers after it");
  CHECK_THROWS(ValidatePlan(with([](PlanSpec& p) { p.blocks[0].op = BlockOp::kAllReduce; })), std::invalid_argument,
               "whose 'after' is not a reduce-scatter");
}

}  // namespace

// Note [Device windows]: with a backend that orders launches on the device, every released block is
// launched at once, in the reference sequence, each behind the oldest blocks holding the slots it takes;
// completions from another thread, in reverse, then finish the iteration, and the next one starts afresh.
TEST(DeviceWindowsLaunchAtOnceBehindTheSlotsTheyTake) {
  PlanSpec plan = SimplePlan({4, 4, 4, 4, 4, 4, 4}, {0, 1, 2, 3, 4, 5, 6}, {2, 0, 0, 0, 0, 0, 0}, {3, 1});
  plan.channels = 2;
  const Reference ref = model::Expect(plan);
  ManualBackend m;
  m.SetOrdersOnDevice(true);
  Scheduler s(&m, ms(5000));
  s.SetPlan(plan);
  s.SetDeviceWindows(true);
  for (int iteration = 0; iteration < 3; ++iteration) {
    const size_t base = m.History().size();
    s.StartIteration();
    for (int32_t t = 0; t < 7; ++t) s.MarkReady(t);
    s.Flush();
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (m.History().size() < base + 7) {
      CHECK_MSG(Clock::now() < deadline, "launched " << m.History().size() - base << " of 7 without completions");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    const auto history = m.History();
    // Block 0 goes alone at its event (window 2); the flush releases 1-3 (window 3), then 4, 5, 6 (window 1):
    // 3 takes block 0's slot, 4 needs the three of 1-3, 5 the one of 4, 6 the one of 5.
    const std::vector<std::vector<int32_t>> behind = {{}, {}, {}, {0}, {1, 2, 3}, {4}, {5}};
    for (int32_t i = 0; i < 7; ++i) {
      CHECK_EQ(history[base + i].block, ref.seq[i]);
      CHECK_EQ(history[base + i].channel, i % plan.channels);
      CHECK_MSG(history[base + i].behind == behind[i], "launch " << i << " behind " << Str(history[base + i].behind));
    }
    std::thread completer([&m] {
      for (int32_t b = 6; b >= 0; --b) CHECK(m.Complete(b));
    });
    s.WaitAll(ms(5000));
    completer.join();
    for (int32_t t = 0; t < 7; ++t) CHECK(s.TensorDone(t));
  }
}

// Without a backend that can order on the device, device windows leave the host's window as it was.
TEST(DeviceWindowsNeedABackendThatOrders) {
  const PlanSpec plan = SimplePlan({4, 4, 4}, {0, 1, 2}, {0, 0, kReleaseAll}, {1});
  const Reference ref = model::Expect(plan);
  ManualBackend m;  // SetOrdersOnDevice not called
  Scheduler s(&m, ms(5000));
  s.SetPlan(plan);
  s.SetDeviceWindows(true);
  Rng rng(check::Opts().seed + 7);
  for (int iteration = 0; iteration < 3; ++iteration) Drive(s, m, plan, ref, rng);
  for (const auto& l : m.History()) CHECK(l.behind.empty());
}
