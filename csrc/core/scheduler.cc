#include "scheduler.h"

#include <algorithm>
#include <functional>
#include <sstream>

namespace dcredit {
namespace {

using Clock = std::chrono::steady_clock;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

std::string Join(const std::vector<int32_t>& v) {
  std::ostringstream out;
  for (size_t i = 0; i < v.size(); ++i) out << (i ? "," : "") << v[i];
  return out.str();
}

}  // namespace

void ValidatePlan(const PlanSpec& plan) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("plan: " + m); };
  const int32_t T = plan.num_tensors;
  if (T < 0) fail("num_tensors is negative");
  if (static_cast<int32_t>(plan.order.size()) != T) fail("order must list every tensor once");
  std::vector<char> seen(T, 0);
  for (int32_t t : plan.order) {
    if (t < 0 || t >= T || seen[t]) fail("order must be a permutation of 0..num_tensors-1");
    seen[t] = 1;
  }
  if (static_cast<int32_t>(plan.phase1_windows.size()) != T) fail("phase1_windows needs one entry per event");
  for (int32_t w : plan.phase1_windows) {
    if (w < 0 && w != kReleaseAll) fail("phase1_windows entries must be >= 0 or kReleaseAll");
  }
  if (plan.phase2_windows.empty()) fail("phase2_windows is empty");
  for (int32_t w : plan.phase2_windows) {
    if (w <= 0) fail("phase2_windows entries must be positive");
  }
  if (plan.credit_bytes < 0) fail("credit_bytes is negative");
  if (plan.channels < 1) fail("channels must be >= 1");
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    const BlockSpec& s = plan.blocks[b];
    if (s.numel <= 0 || s.bytes <= 0 || s.offset < 0 || s.segment < 0) {
      fail("block " + std::to_string(b) + " has a non-positive size or a negative offset/segment");
    }
    if (s.tensors.empty()) fail("block " + std::to_string(b) + " covers no tensor");
    for (int32_t t : s.tensors) {
      if (t < 0 || t >= T) fail("block " + std::to_string(b) + " covers a tensor out of range");
    }
    const auto op = static_cast<int32_t>(s.op);
    if (op < 0 || op > static_cast<int32_t>(BlockOp::kAllGather)) fail("block " + std::to_string(b) + " has op " +
                                                                       std::to_string(op));
    // Note [Two-stage blocks]: `after` must be released before this block on every path, or the head of
    // the launch sequence would wait for a block queued behind it.
    if (s.after == -1) continue;
    const std::string which = "block " + std::to_string(b) + " waits for block " + std::to_string(s.after);
    if (s.after < 0 || s.after >= static_cast<int32_t>(b)) fail(which + ": 'after' must be an earlier block");
    const BlockSpec& a = plan.blocks[s.after];
    if (a.tensors != s.tensors) fail(which + ", which covers other tensors");
    if (a.priority > s.priority) fail(which + ", which has a lower priority (a larger number)");
    if (a.at_flush && !s.at_flush) fail(which + ", which is held until the flush while this one is not");
  }
  // A reduce-scatter leaves only a shard reduced: the all-gather that follows it is what completes the block.
  std::vector<int32_t> gathers(plan.blocks.size(), 0);
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    const BlockSpec& s = plan.blocks[b];
    if (s.op != BlockOp::kAllGather) continue;
    if (s.after < 0 || plan.blocks[s.after].op != BlockOp::kReduceScatter) {
      fail("block " + std::to_string(b) + " is an all-gather whose 'after' is not a reduce-scatter block");
    }
    ++gathers[s.after];
  }
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    if (plan.blocks[b].op == BlockOp::kReduceScatter && gathers[b] != 1) {
      fail("block " + std::to_string(b) + " is a reduce-scatter with " + std::to_string(gathers[b]) +
           " all-gathers after it; it needs exactly one");
    }
  }
}

// Everything the dispatch thread and the completion callbacks share. Held by
// shared_ptr so a completion that arrives after Shutdown (a collective the
// backend could not cancel) still finds live memory.
struct Scheduler::Core {
  explicit Core(Backend* b, std::chrono::milliseconds t) : backend(b), timeout(t) {}

  Backend* backend;
  const std::chrono::milliseconds timeout;

  std::mutex mu;
  std::condition_variable dispatch_cv;  // wakes the dispatch thread
  std::condition_variable done_cv;      // wakes waiters

  // Plan, fixed between SetPlan calls.
  PlanSpec plan;
  std::vector<std::vector<int32_t>> tensor_blocks;  // blocks covering each tensor

  // Per iteration.
  bool open = false;
  uint64_t generation = 0;  // bumps per iteration; stale completions are ignored
  std::vector<char> arrived;
  std::vector<int64_t> ready_ns;
  int32_t next_event = 0;
  bool flushed = false;
  int32_t phase2_group = 0;
  int32_t groups = 0;
  std::vector<int32_t> deps;            // per block: covered tensors not yet processed
  std::vector<int32_t> tensor_pending;  // per tensor: covering blocks not yet done
  using Key = std::pair<int32_t, int32_t>;  // (priority, block id)
  std::priority_queue<Key, std::vector<Key>, std::greater<Key>> heap;
  std::vector<int32_t> held;         // ready, released only at the flush (BlockSpec::at_flush)
  std::deque<int32_t> launch_queue;  // released, not yet launched, in order
  std::deque<int32_t> in_flight;     // launched, in launch order (done ones popped lazily)
  std::vector<char> done;
  int32_t in_flight_count = 0;
  // Note [Device windows]: blocks in flight that hold a slot of the window (a block whose slot a later
  // launch took over on the device holds none), and per block whether it gave its slot away.
  bool device_windows = false;
  int32_t holding_count = 0;
  std::vector<char> handed_over;
  int64_t in_flight_bytes = 0;
  int64_t seq = 0;
  int32_t done_count = 0;
  std::vector<BlockTrace> trace;

  Status error;  // sticky: the first failure
  bool stop = false;

  int32_t NumBlocks() const { return static_cast<int32_t>(plan.blocks.size()); }

  void Fail(Status s) {
    if (error.ok()) error = std::move(s);
    dispatch_cv.notify_all();
    done_cv.notify_all();
  }

  // Moves up to `window` ready blocks, highest priority first, into the
  // launch sequence as one group. See Note [Credit window].
  void Release(int32_t window) {
    int32_t take = window == kReleaseAll ? static_cast<int32_t>(heap.size())
                                         : std::min<int32_t>(window, static_cast<int32_t>(heap.size()));
    if (take <= 0) return;
    const int32_t group_window = window == kReleaseAll ? take : window;
    const int64_t now = NowNs();
    const int32_t group = groups++;
    for (int32_t i = 0; i < take; ++i) {
      const int32_t b = heap.top().second;
      heap.pop();
      BlockTrace& tr = trace[b];
      tr.window = group_window;
      tr.group = group;
      tr.release_ns = now;
      launch_queue.push_back(b);
    }
    dispatch_cv.notify_one();
  }

  // Processes buffered events strictly in plan order.
  // See Note [Same order on every rank].
  void ProcessEvents() {
    const int32_t T = plan.num_tensors;
    while (next_event < T && arrived[plan.order[next_event]]) {
      const int32_t t = plan.order[next_event];
      for (int32_t b : tensor_blocks[t]) {
        if (--deps[b] != 0) continue;
        if (plan.blocks[b].at_flush) {
          held.push_back(b);
        } else {
          heap.emplace(plan.blocks[b].priority, b);
        }
      }
      Release(plan.phase1_windows[next_event]);
      ++next_event;
    }
  }

  // Whether block `b` may launch now; where the window is full but the device can keep it (Note [Device
  // windows]), `behind` gets the oldest blocks holding a slot whose results b's launch must wait for.
  bool CanLaunch(int32_t b, std::vector<int32_t>* behind) {
    behind->clear();
    const int32_t first = plan.blocks[b].after;
    if (first >= 0 && !done[first]) return false;  // Note [Two-stage blocks]
    const BlockTrace& tr = trace[b];
    if (device_windows && plan.credit_bytes == 0) {
      if (holding_count < tr.window) return true;
      const int32_t need = holding_count - tr.window + 1;
      for (int32_t o : in_flight) {
        if (static_cast<int32_t>(behind->size()) == need) break;
        if (done[o] || handed_over[o]) continue;
        if (!backend->CanOrderAfter(o)) {
          behind->clear();
          return false;  // its result is not enqueued yet: wait on the host, as without device windows
        }
        behind->push_back(o);
      }
      if (static_cast<int32_t>(behind->size()) == need) return true;
      behind->clear();
      return false;
    }
    if (in_flight_count >= tr.window) return false;
    if (plan.credit_bytes > 0 && in_flight_count > 0 &&
        in_flight_bytes + plan.blocks[b].bytes > plan.credit_bytes) {
      return false;  // an oversized block waits until it can go alone
    }
    return true;
  }

  void OnDone(uint64_t gen, int32_t b, const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (gen != generation || done[b]) return;
    trace[b].end_ns = NowNs();
    done[b] = 1;
    ++done_count;
    --in_flight_count;
    if (!handed_over[b]) --holding_count;
    in_flight_bytes -= plan.blocks[b].bytes;
    if (!s.ok()) {
      Fail(Status{s.code, Describe(b) + " failed: " + s.message});
      return;
    }
    bool tensor_finished = false;
    for (int32_t t : plan.blocks[b].tensors) {
      if (--tensor_pending[t] == 0) tensor_finished = true;
    }
    dispatch_cv.notify_one();
    if (tensor_finished || done_count == NumBlocks() || ReleasedDone()) done_cv.notify_all();
  }

  // Every released block launched and done (WaitReleased).
  bool ReleasedDone() const { return launch_queue.empty() && in_flight_count == 0; }

  // The oldest block still in flight, or -1.
  int32_t OldestInFlight() {
    while (!in_flight.empty() && done[in_flight.front()]) in_flight.pop_front();
    return in_flight.empty() ? -1 : in_flight.front();
  }

  // For a wait that timed out: the block holding things up, if one is in flight.
  std::string Stuck() {
    const int32_t oldest = OldestInFlight();
    if (oldest < 0) return "";
    return "; oldest in flight: " + Describe(oldest) + ", a peer may be dead, stalled, or issuing different "
           "collectives";
  }

  std::string Describe(int32_t b) const {
    std::ostringstream m;
    m << "block " << b << " (tensors " << Join(plan.blocks[b].tensors) << ", " << plan.blocks[b].bytes
      << " bytes, channel " << trace[b].channel << ", launch " << trace[b].seq << ", "
      << (flushed ? "phase 2" : "phase 1") << ")";
    return m.str();
  }
};

// Note [Two-stage blocks]
// A collective may be cut in two stages that run at different times: a
// reduce-scatter during backward and an all-gather of its result while the
// next forward runs (DeAR), each a block of its own. The second stage names
// the first in `after` and covers the same tensors, so both become ready at
// the same event; its launch waits until the first has completed. That wait
// decides only *when* it launches, never *which* block goes next: a block
// whose `after` has not completed stops the launch sequence at its place,
// so the sequence stays the same on every rank (Note [Same order on every
// rank]). No deadlock: ValidatePlan makes `after` an earlier block of no
// lower priority, held until the flush only if this one is too, so it is
// always released, and so launched, before the block that waits for it. A
// block with `at_flush` is kept out of phase 1 even when ready: the flush
// puts it in the heap with everything left, in priority order, so second
// stages go in forward order while the next forward runs. `op` is for the
// backend; the scheduler treats every block alike.
//
// Note [Device windows]
// The credit window (Note [Credit window]) counts blocks in flight until the
// backend reports them done. On a GPU "done" means the device has finished
// the collective (Note [CUDA streams], rule 3), so a block whose window is
// full waits on the host for the device, and so does a lazy update that
// needs it: the host cannot queue the next forward's kernels meanwhile
// (measured on an H200: 0.52 ms per VGG-like iteration with a phase-2
// window of one block). With device windows on (Config.device_windows) and
// a backend that can order a launch behind a block on the device
// (Backend::CanOrderAfter: a CUDA block whose final event is recorded), such
// a block is launched at once instead: it takes over the slots of the
// oldest blocks still holding one, and its collective waits on the device
// for their results (Backend::OrderNextAfter). A block whose slot was taken
// over holds none any more; its completion frees nothing. So at most
// `window` collectives run at once on the device, as the plan asked, while
// the host never waits to launch. What does not change: the launch
// sequence (releases and their order are untouched; only the moment of
// launch moves), so every rank still issues the same collectives in the
// same order; the two-stage wait (`after`) and byte credits stay on the host
// (device windows apply only without credit_bytes). No deadlock: a launch
// waits only for blocks launched before it. Where the backend cannot order
// (CPU blocks; a result not yet enqueued, as with Gloo's CUDA path), the
// host waits as before and the block goes when a completion frees a slot.
//
// Note [Dispatch loop]
// The constraints that shape this loop:
//  1. Only this thread launches, so launches happen in exactly the order of
//     the launch sequence (Note [Same order on every rank]).
//  2. Backend::Launch runs without the lock: a backend may complete inline
//     and re-enter OnDone, and a real collective launch may take a while.
//  3. Nothing polls: the thread sleeps on dispatch_cv until a release or a
//     completion may allow a launch, or until the oldest block in flight
//     would exceed the timeout (the only timed wake).
//  4. Several launches are taken per lock hold to keep the per-block cost
//     far below a microsecond.
void Scheduler::DispatchLoop(std::shared_ptr<Core> core) {
  NameThisThread("dc_dispatch");
  struct Launch {
    int32_t block;
    int32_t channel;
    std::vector<int32_t> behind;  // Note [Device windows]
  };
  std::vector<Launch> batch;
  std::vector<int32_t> behind;
  std::unique_lock<std::mutex> lock(core->mu);
  uint64_t gen = 0;
  while (true) {
    if (core->stop) return;
    batch.clear();
    if (core->error.ok()) {
      const int64_t now = core->launch_queue.empty() ? 0 : NowNs();  // one clock read per batch
      while (!core->launch_queue.empty() && core->CanLaunch(core->launch_queue.front(), &behind)) {
        const int32_t b = core->launch_queue.front();
        core->launch_queue.pop_front();
        BlockTrace& tr = core->trace[b];
        tr.seq = core->seq++;
        tr.channel = static_cast<int32_t>(tr.seq % core->plan.channels);
        tr.launch_ns = now;
        ++core->in_flight_count;
        core->in_flight_bytes += core->plan.blocks[b].bytes;
        core->in_flight.push_back(b);
        for (int32_t o : behind) core->handed_over[o] = 1;
        core->holding_count += 1 - static_cast<int32_t>(behind.size());
        batch.push_back({b, tr.channel, behind});
        // A block ordered behind another waits for its final event, recorded at that one's launch: launch
        // it in the next round, after this batch's launches (CanOrderAfter says so then).
        if (!behind.empty()) break;
      }
    }
    if (!batch.empty()) {
      gen = core->generation;
      lock.unlock();
      for (const Launch& l : batch) {
        if (!l.behind.empty()) core->backend->OrderNextAfter(l.behind);
        core->backend->Launch(l.block, l.channel, [core, gen, b = l.block](Status s) { core->OnDone(gen, b, s); });
      }
      lock.lock();
      continue;
    }
    const int32_t oldest = core->error.ok() ? core->OldestInFlight() : -1;
    if (oldest < 0) {
      core->dispatch_cv.wait(lock);
      continue;
    }
    const auto deadline = Clock::time_point(std::chrono::nanoseconds(core->trace[oldest].launch_ns)) + core->timeout;
    if (core->dispatch_cv.wait_until(lock, deadline) == std::cv_status::timeout && !core->stop &&
        core->error.ok() && !core->done[oldest] && core->trace[oldest].launch_ns != 0 &&
        Clock::now() >= deadline) {
      std::ostringstream m;
      m << core->Describe(oldest) << " did not complete within " << core->timeout.count() / 1000.0
        << " s: a peer is dead, stalled, or issuing different collectives";
      core->Fail(Status::Timeout(m.str()));
    }
  }
}

Scheduler::Scheduler(Backend* backend, std::chrono::milliseconds timeout)
    : core_(std::make_shared<Core>(backend, timeout)) {
  if (backend == nullptr) throw std::invalid_argument("Scheduler needs a backend");
  if (timeout.count() <= 0) throw std::invalid_argument("Scheduler timeout must be positive");
  thread_ = std::thread(DispatchLoop, core_);
}

Scheduler::~Scheduler() { Shutdown(); }

void Scheduler::SetPlan(PlanSpec plan) {
  ValidatePlan(plan);
  std::lock_guard<std::mutex> lock(core_->mu);
  Core& c = *core_;
  if (!c.error.ok()) throw SchedulerError(c.error);
  if (c.open && c.done_count != c.NumBlocks()) {
    throw std::logic_error("SetPlan while an iteration still has blocks pending");
  }
  c.plan = std::move(plan);
  c.tensor_blocks.assign(c.plan.num_tensors, {});
  for (int32_t b = 0; b < c.NumBlocks(); ++b) {
    for (int32_t t : c.plan.blocks[b].tensors) c.tensor_blocks[t].push_back(b);
  }
  c.open = false;
}

void Scheduler::SetDeviceWindows(bool on) {
  std::lock_guard<std::mutex> lock(core_->mu);
  Core& c = *core_;
  if (c.open && c.done_count != c.NumBlocks()) {
    throw std::logic_error("SetDeviceWindows while an iteration still has blocks pending");
  }
  c.device_windows = on;
}

void Scheduler::StartIteration() {
  std::lock_guard<std::mutex> lock(core_->mu);
  Core& c = *core_;
  if (c.stop) throw SchedulerError(Status::Shutdown("scheduler is shut down"));
  if (!c.error.ok()) throw SchedulerError(c.error);
  if (c.open && c.done_count != c.NumBlocks()) {
    throw std::logic_error("StartIteration while the previous iteration still has blocks pending");
  }
  const int32_t T = c.plan.num_tensors;
  const int32_t B = c.NumBlocks();
  ++c.generation;
  c.open = true;
  c.arrived.assign(T, 0);
  c.ready_ns.assign(T, 0);
  c.next_event = 0;
  c.flushed = false;
  c.phase2_group = 0;
  c.groups = 0;
  c.deps.resize(B);
  c.done.assign(B, 0);
  c.trace.assign(B, BlockTrace{});
  for (int32_t b = 0; b < B; ++b) {
    c.deps[b] = static_cast<int32_t>(c.plan.blocks[b].tensors.size());
    c.trace[b].block = b;
  }
  c.tensor_pending.resize(T);
  for (int32_t t = 0; t < T; ++t) c.tensor_pending[t] = static_cast<int32_t>(c.tensor_blocks[t].size());
  c.heap = {};
  c.held.clear();
  c.launch_queue.clear();
  c.in_flight.clear();
  c.in_flight_count = 0;
  c.holding_count = 0;
  c.handed_over.assign(B, 0);
  c.in_flight_bytes = 0;
  c.seq = 0;
  c.done_count = 0;
}

void Scheduler::MarkReady(int32_t tensor) {
  std::lock_guard<std::mutex> lock(core_->mu);
  Core& c = *core_;
  if (!c.error.ok()) throw SchedulerError(c.error);
  if (!c.open) throw std::logic_error("MarkReady before StartIteration");
  if (tensor < 0 || tensor >= c.plan.num_tensors) {
    throw std::out_of_range("MarkReady: tensor " + std::to_string(tensor) + " out of range");
  }
  if (c.arrived[tensor]) {
    throw std::logic_error("tensor " + std::to_string(tensor) + " marked ready twice in one iteration");
  }
  c.arrived[tensor] = 1;
  c.ready_ns[tensor] = NowNs();
  c.ProcessEvents();
}

void Scheduler::Flush() {
  std::lock_guard<std::mutex> lock(core_->mu);
  Core& c = *core_;
  if (!c.error.ok()) throw SchedulerError(c.error);
  if (!c.open) throw std::logic_error("Flush before StartIteration");
  if (c.flushed) return;
  const int64_t now = NowNs();
  for (int32_t t = 0; t < c.plan.num_tensors; ++t) {
    if (!c.arrived[t]) {
      c.arrived[t] = 1;
      c.ready_ns[t] = now;
    }
  }
  c.ProcessEvents();
  c.flushed = true;
  for (int32_t b : c.held) c.heap.emplace(c.plan.blocks[b].priority, b);
  c.held.clear();
  const auto& w = c.plan.phase2_windows;
  while (!c.heap.empty()) {
    c.Release(w[std::min<size_t>(c.phase2_group, w.size() - 1)]);
    ++c.phase2_group;
  }
}

void Scheduler::WaitTensor(int32_t tensor, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(core_->mu);
  Core& c = *core_;
  if (tensor < 0 || tensor >= c.plan.num_tensors) {
    throw std::out_of_range("WaitTensor: tensor " + std::to_string(tensor) + " out of range");
  }
  const bool finished = c.done_cv.wait_for(lock, timeout, [&] {
    return c.stop || !c.error.ok() || !c.open || c.tensor_pending[tensor] == 0;
  });
  if (!c.error.ok()) throw SchedulerError(c.error);
  if (c.stop) throw SchedulerError(Status::Shutdown("scheduler shut down while waiting"));
  if (!c.open) return;
  if (!finished) {
    std::ostringstream m;
    m << "tensor " << tensor << " not reduced within " << timeout.count() / 1000.0 << " s ("
      << c.tensor_pending[tensor] << " of its blocks pending; "
      << (c.arrived[tensor] ? "its gradient was marked ready" : "its gradient was never marked ready") << ", "
      << (c.flushed ? "after the flush" : "before the flush") << ")" << c.Stuck();
    throw SchedulerError(Status::Timeout(m.str()));
  }
}

void Scheduler::WaitAll(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(core_->mu);
  Core& c = *core_;
  const bool finished = c.done_cv.wait_for(lock, timeout, [&] {
    return c.stop || !c.error.ok() || !c.open || c.done_count == c.NumBlocks();
  });
  if (!c.error.ok()) throw SchedulerError(c.error);
  if (c.stop) throw SchedulerError(Status::Shutdown("scheduler shut down while waiting"));
  if (!finished) {
    std::ostringstream m;
    m << "iteration not reduced within " << timeout.count() / 1000.0 << " s (" << c.NumBlocks() - c.done_count
      << " of " << c.NumBlocks() << " blocks pending, " << c.launch_queue.size() << " queued, "
      << c.in_flight_count << " in flight, " << (c.flushed ? "after the flush" : "before the flush") << ")"
      << c.Stuck();
    throw SchedulerError(Status::Timeout(m.str()));
  }
}

void Scheduler::WaitReleased(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(core_->mu);
  Core& c = *core_;
  const bool finished = c.done_cv.wait_for(lock, timeout, [&] {
    return c.stop || !c.error.ok() || !c.open || c.ReleasedDone();
  });
  if (!c.open || c.ReleasedDone()) return;  // nothing of ours in flight, even after a failure or a shutdown
  if (!c.error.ok()) throw SchedulerError(c.error);
  if (c.stop) throw SchedulerError(Status::Shutdown("scheduler shut down while waiting"));
  if (!finished) {
    std::ostringstream m;
    m << "the released blocks not reduced within " << timeout.count() / 1000.0 << " s ("
      << c.launch_queue.size() << " queued, " << c.in_flight_count << " in flight, "
      << (c.flushed ? "after the flush" : "before the flush") << ")" << c.Stuck();
    throw SchedulerError(Status::Timeout(m.str()));
  }
}

bool Scheduler::TensorDone(int32_t tensor) {
  std::lock_guard<std::mutex> lock(core_->mu);
  Core& c = *core_;
  if (tensor < 0 || tensor >= c.plan.num_tensors) return false;
  return !c.open || c.tensor_pending[tensor] == 0;
}

bool Scheduler::Idle() {
  std::lock_guard<std::mutex> lock(core_->mu);
  return !core_->open || core_->done_count == core_->NumBlocks();
}

void Scheduler::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->stop = true;
    if (core_->open && core_->done_count != core_->NumBlocks()) {
      core_->Fail(Status::Shutdown("scheduler shut down with " +
                                   std::to_string(core_->NumBlocks() - core_->done_count) + " blocks pending"));
    }
    core_->dispatch_cv.notify_all();
    core_->done_cv.notify_all();
  }
  std::lock_guard<std::mutex> join_lock(join_mu_);
  if (thread_.joinable()) thread_.join();
}

std::vector<BlockTrace> Scheduler::Trace() {
  std::lock_guard<std::mutex> lock(core_->mu);
  return core_->trace;
}

std::vector<int64_t> Scheduler::ReadyTimes() {
  std::lock_guard<std::mutex> lock(core_->mu);
  return core_->ready_ns;
}

Status Scheduler::status() {
  std::lock_guard<std::mutex> lock(core_->mu);
  return core_->error;
}

int32_t Scheduler::num_blocks() {
  std::lock_guard<std::mutex> lock(core_->mu);
  return core_->NumBlocks();
}

int32_t Scheduler::num_tensors() {
  std::lock_guard<std::mutex> lock(core_->mu);
  return core_->plan.num_tensors;
}

}  // namespace dcredit
