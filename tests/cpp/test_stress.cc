// Many threads at once: gradients marked ready from several threads in
// random orders while completions come back from several other threads in
// random order (and sometimes inline, inside Launch). Meant to be run under
// ThreadSanitizer and AddressSanitizer too (tests/cpp/run.sh).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
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

// Completes launches from `completers` threads, each taking a random one of
// the launches waiting, so completions come back in random order. Checks,
// at every launch, what the scheduler promises: the launch sequence of the
// reference model, channel = launch number % channels, fewer than the
// block's window in flight and the byte credit respected, and that every
// block completes exactly once.
//
// Our in-flight set is a subset of the scheduler's: it counts a launch only
// once Launch runs (the scheduler counted it before), and drops a block
// before calling `done` (the scheduler drops it inside). So the limits that
// held for the scheduler's set hold for ours, and a violation here is real.
class ThreadedBackend : public Backend {
 public:
  ThreadedBackend(int completers, uint64_t seed, int inline_percent) : inline_percent_(inline_percent) {
    for (int i = 0; i < completers; ++i) threads_.emplace_back([this, i, seed] { Complete(seed + 1000 + i); });
  }

  ~ThreadedBackend() override {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      stop_ = true;
    }
    queue_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // Expect one iteration of `plan`; only while nothing is in flight.
  void Arm(const PlanSpec* plan, const Reference* ref) {
    std::lock_guard<std::mutex> lock(acct_mu_);
    CHECK_EQ(in_flight_, 0);
    plan_ = plan;
    ref_ = ref;
    launches_ = 0;
    launched_.assign(plan->blocks.size(), 0);
    completed_.assign(plan->blocks.size(), 0);
  }

  void Launch(int32_t block, int32_t channel, Done done) override {
    {
      std::lock_guard<std::mutex> lock(acct_mu_);
      const int32_t n = launches_++;
      CHECK(n < static_cast<int32_t>(ref_->seq.size()));
      CHECK_MSG(block == ref_->seq[n], "launch " << n << " is block " << block << ", expected " << ref_->seq[n]);
      CHECK_EQ(channel, n % plan_->channels);
      CHECK_EQ(launched_[block]++, 0);
      CHECK_MSG(in_flight_ < ref_->window[block],
                "block " << block << " launched with " << in_flight_ << " in flight, window " << ref_->window[block]);
      const int64_t bytes = plan_->blocks[block].bytes;
      CHECK_MSG(plan_->credit_bytes == 0 || in_flight_ == 0 || in_flight_bytes_ + bytes <= plan_->credit_bytes,
                "block " << block << " overdraws the credit");
      ++in_flight_;
      in_flight_bytes_ += bytes;
      max_in_flight_ = std::max(max_in_flight_, in_flight_);
    }
    if (inline_percent_ > 0 && static_cast<int>(Hash(block) % 100) < inline_percent_) {
      Finish(block, done);  // a backend may complete before Launch returns
      return;
    }
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      queue_.emplace_back(block, std::move(done));
    }
    queue_cv_.notify_one();
  }

  bool Completed(int32_t block) {
    std::lock_guard<std::mutex> lock(acct_mu_);
    return completed_[block] == 1;
  }

  void CheckAllOnce() {
    std::lock_guard<std::mutex> lock(acct_mu_);
    CHECK_EQ(in_flight_, 0);
    CHECK_EQ(launches_, static_cast<int32_t>(plan_->blocks.size()));
    for (size_t b = 0; b < completed_.size(); ++b) {
      CHECK_MSG(launched_[b] == 1 && completed_[b] == 1,
                "block " << b << " launched " << int(launched_[b]) << "x, completed " << int(completed_[b]) << "x");
    }
  }

  int32_t max_in_flight() {
    std::lock_guard<std::mutex> lock(acct_mu_);
    return max_in_flight_;
  }

 private:
  static uint64_t Hash(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    return x ^ (x >> 33);
  }

  void Finish(int32_t block, Done& done) {
    {
      std::lock_guard<std::mutex> lock(acct_mu_);
      --in_flight_;
      in_flight_bytes_ -= plan_->blocks[block].bytes;
      CHECK_EQ(completed_[block]++, 0);
    }
    done(Status::Ok());
  }

  void Complete(uint64_t seed) {
    Rng rng(seed);
    while (true) {
      std::pair<int32_t, Done> item;
      {
        std::unique_lock<std::mutex> lock(queue_mu_);
        queue_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        const size_t i = rng() % queue_.size();
        std::swap(queue_[i], queue_.back());
        item = std::move(queue_.back());
        queue_.pop_back();
      }
      if (rng() % 8 == 0) std::this_thread::yield();  // vary the interleavings
      Finish(item.first, item.second);
    }
  }

  const int inline_percent_;
  std::mutex acct_mu_;
  const PlanSpec* plan_ = nullptr;
  const Reference* ref_ = nullptr;
  int32_t launches_ = 0;
  int32_t in_flight_ = 0;
  int64_t in_flight_bytes_ = 0;
  int32_t max_in_flight_ = 0;
  std::vector<char> launched_;
  std::vector<char> completed_;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::vector<std::pair<int32_t, Done>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// One iteration: `markers` threads mark their share of the gradients in a
// random order (some are left to the flush), a waiter thread waits on random
// tensors and checks their blocks really completed, then flush and wait.
void RunIteration(Scheduler& s, ThreadedBackend& backend, const PlanSpec& plan, const Reference& ref, Rng& rng,
                  int markers) {
  backend.Arm(&plan, &ref);
  s.StartIteration();
  std::vector<int32_t> tensors(plan.num_tensors);
  for (int32_t t = 0; t < plan.num_tensors; ++t) tensors[t] = t;
  std::shuffle(tensors.begin(), tensors.end(), rng);
  if (rng() % 4 == 0) tensors.resize(tensors.size() * (rng() % 100) / 100);  // unused on this rank
  std::vector<std::vector<int32_t>> share(markers);
  for (size_t i = 0; i < tensors.size(); ++i) share[i % markers].push_back(tensors[i]);
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int k = 0; k < markers; ++k) {
    threads.emplace_back([&, k] {
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      for (size_t i = 0; i < share[k].size(); ++i) {
        s.MarkReady(share[k][i]);
        if ((i + k) % 16 == 0) std::this_thread::yield();
      }
    });
  }
  const uint64_t wait_seed = rng();
  threads.emplace_back([&, wait_seed] {
    Rng local(wait_seed);
    for (int i = 0; i < 4; ++i) {
      const int32_t t = static_cast<int32_t>(local() % plan.num_tensors);
      s.WaitTensor(t, ms(60000));
      for (int32_t b : ref.tensor_blocks[t]) CHECK_MSG(backend.Completed(b), "tensor " << t << " done before block " << b);
    }
  });
  go.store(true, std::memory_order_release);
  for (int k = 0; k < markers; ++k) threads[k].join();
  s.Flush();
  s.WaitAll(ms(60000));
  threads.back().join();
  backend.CheckAllOnce();
  const std::vector<BlockTrace> trace = s.Trace();
  for (size_t b = 0; b < trace.size(); ++b) {
    CHECK_EQ(trace[b].seq, static_cast<int64_t>(ref.pos[b]));
    CHECK_EQ(trace[b].window, ref.window[b]);
  }
}

TEST(StressManyThreadsRandomOrders) {
  Rng rng(check::Opts().seed);
  const int64_t target = check::Opts().stress_blocks;
  model::PlanShape shape;
  shape.max_tensors = 160;
  shape.max_blocks_per_tensor = 8;
  shape.max_window = 8;
  const auto start = std::chrono::steady_clock::now();
  int64_t blocks = 0;
  int64_t iterations = 0;
  int32_t max_in_flight = 0;
  // A few backends (completer-thread counts and inline shares), a fresh
  // random plan every few iterations, until enough blocks went through.
  for (int round = 0; blocks < target; ++round) {
    ThreadedBackend backend(2 + round % 3, rng(), round % 2 == 0 ? 0 : 20);
    Scheduler s(&backend, ms(60000));
    for (int p = 0; p < 8 && blocks < target; ++p) {
      const PlanSpec plan = model::RandomPlan(rng, shape);
      const Reference ref = model::Expect(plan);
      s.SetPlan(plan);
      for (int it = 0; it < 4; ++it) {
        RunIteration(s, backend, plan, ref, rng, 1 + static_cast<int>(rng() % 4));
        blocks += static_cast<int64_t>(plan.blocks.size());
        ++iterations;
      }
    }
    CHECK(s.status().ok());
    max_in_flight = std::max(max_in_flight, backend.max_in_flight());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("  stress: %lld blocks in %lld iterations, max %d in flight, %.2f s\n", static_cast<long long>(blocks),
              static_cast<long long>(iterations), max_in_flight, seconds);
}

// NoopBackend completes on the dispatch thread itself, inside Launch,
// while other threads mark gradients ready.
TEST(StressNoopBackendConcurrentMarks) {
  Rng rng(check::Opts().seed + 7);
  NoopBackend backend;
  Scheduler s(&backend, ms(60000));
  model::PlanShape shape;
  shape.max_tensors = 200;
  shape.max_blocks_per_tensor = 8;
  shape.max_window = 8;
  for (int p = 0; p < 20; ++p) {
    const PlanSpec plan = model::RandomPlan(rng, shape);
    const Reference ref = model::Expect(plan);
    s.SetPlan(plan);
    for (int it = 0; it < 5; ++it) {
      s.StartIteration();
      std::vector<std::thread> markers;
      for (int k = 0; k < 3; ++k) {
        markers.emplace_back([&, k] {
          for (int32_t t = k; t < plan.num_tensors; t += 3) s.MarkReady(plan.order[plan.num_tensors - 1 - t]);
        });
      }
      for (auto& m : markers) m.join();
      s.Flush();
      s.WaitAll(ms(60000));
      const auto trace = s.Trace();
      for (size_t b = 0; b < trace.size(); ++b) CHECK_EQ(trace[b].seq, static_cast<int64_t>(ref.pos[b]));
    }
  }
}

// Shutdown while launches are in flight and completers still hold their
// callbacks; the scheduler is destroyed before they call back.
TEST(StressShutdownWithCompletionsInFlight) {
  Rng rng(check::Opts().seed + 11);
  model::PlanShape shape;
  shape.max_tensors = 40;
  for (int round = 0; round < 100; ++round) {
    // Declared before the backend: its completers read them while draining.
    const PlanSpec plan = model::RandomPlan(rng, shape);
    const Reference ref = model::Expect(plan);
    ThreadedBackend backend(2, rng(), 0);
    backend.Arm(&plan, &ref);
    {
      Scheduler s(&backend, ms(60000));
      s.SetPlan(plan);
      s.StartIteration();
      std::thread waiter([&] {
        try {
          s.WaitAll(ms(60000));
        } catch (const SchedulerError& e) {
          CHECK(e.status.code == StatusCode::kShutdown);
        }
      });
      s.Flush();
      if (rng() % 2) std::this_thread::yield();
      s.Shutdown();
      waiter.join();
    }
    // ~ThreadedBackend drains the queue: late callbacks into a dead scheduler.
  }
}

}  // namespace
