// The credit scheduler: blocks, priorities, windows, one dispatch thread.
//
// This layer knows nothing about tensors or process groups. A Backend
// launches one block's collective and reports its completion; the Scheduler
// decides which block goes next and when. See dcredit_opt/planner/plan.py
// for the plan's semantics: Note [Same order on every rank] and
// Note [Credit window] are implemented here.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#ifdef __linux__
#include <pthread.h>
#endif

namespace dcredit {

// Names the calling thread as `top -H`, profilers and /proc/<pid>/task/*/comm show it (at most 15
// characters; Linux only, elsewhere nothing).
inline void NameThisThread(const char* name) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

enum class StatusCode { kOk = 0, kError = 1, kTimeout = 2, kShutdown = 3 };

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;

  bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return {}; }
  static Status Error(std::string m) { return {StatusCode::kError, std::move(m)}; }
  static Status Timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
  static Status Shutdown(std::string m) { return {StatusCode::kShutdown, std::move(m)}; }
};

// Thrown by the blocking calls; `status` says why.
class SchedulerError : public std::runtime_error {
 public:
  explicit SchedulerError(Status s) : std::runtime_error(s.message), status(std::move(s)) {}
  Status status;
};

// What a block's collective is. The scheduler only carries it to the
// backend; see Note [Two-stage blocks] in scheduler.cc.
enum class BlockOp : int32_t { kAllReduce = 0, kReduceScatter = 1, kAllGather = 2 };

// One block: a contiguous range of one flat gradient buffer ("segment").
struct BlockSpec {
  int32_t segment = 0;
  int64_t offset = 0;  // elements into the segment
  int64_t numel = 0;
  int64_t bytes = 0;
  int32_t priority = 0;          // lower goes first
  std::vector<int32_t> tensors;  // tensors this block covers (one, or a merge)
  // Note [Two-stage blocks]: the block whose completion this one's launch
  // waits for (-1: none), and whether it is released only at the flush.
  int32_t after = -1;
  bool at_flush = false;
  BlockOp op = BlockOp::kAllReduce;
};

// Sentinel in `phase1_windows`: release every ready block at that event.
constexpr int32_t kReleaseAll = -1;

struct PlanSpec {
  int32_t num_tensors = 0;
  std::vector<int32_t> order;           // events: tensors in expected ready order
  std::vector<BlockSpec> blocks;        // block id = index
  std::vector<int32_t> phase1_windows;  // one per event; kReleaseAll, 0, or > 0
  std::vector<int32_t> phase2_windows;  // group sizes at the flush; last repeats
  int64_t credit_bytes = 0;             // 0 = no byte limit
  int32_t channels = 1;
};

// Throws std::invalid_argument naming the field when the plan cannot run.
void ValidatePlan(const PlanSpec& plan);

// How one block's collective is started. `done` must be called exactly
// once, from any thread, possibly before Launch returns.
class Backend {
 public:
  using Done = std::function<void(Status)>;
  virtual ~Backend() = default;
  virtual void Launch(int32_t block, int32_t channel, Done done) = 0;
  // Note [Device windows]: whether a launch can wait on the device for
  // launched `block`'s result (its final event is recorded), so that the
  // credit window holds on the device while the host launches at once.
  // Called by the dispatch thread under the scheduler's lock: it must not
  // call back into the scheduler.
  virtual bool CanOrderAfter(int32_t /*block*/) { return false; }
  // The next Launch waits on the device for `blocks` (each one
  // CanOrderAfter said true for). Dispatch thread only, right before it.
  virtual void OrderNextAfter(const std::vector<int32_t>& /*blocks*/) {}
};

// What happened to one block in the current iteration (nanoseconds on the
// steady clock; 0 = not yet).
struct BlockTrace {
  int32_t block = 0;
  int32_t channel = -1;
  int32_t window = 0;
  int32_t group = -1;  // release group, in release order
  int64_t seq = -1;    // launch sequence number
  int64_t release_ns = 0;
  int64_t launch_ns = 0;
  int64_t end_ns = 0;
};

class Scheduler {
 public:
  // `backend` must outlive the scheduler's last Launch; Shutdown() joins
  // the dispatch thread so no Launch happens after it returns.
  Scheduler(Backend* backend, std::chrono::milliseconds timeout);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Installs a plan. Only between iterations (nothing pending).
  void SetPlan(PlanSpec plan);
  // Note [Device windows]: count the credit window on the device where the
  // backend can (Backend::CanOrderAfter). Only between iterations.
  void SetDeviceWindows(bool on);
  // Opens an iteration: every tensor not yet ready, every block pending.
  // Throws if the previous iteration still has blocks in flight.
  void StartIteration();
  // Gradient of `tensor` is final. Thread-safe; events may arrive in any
  // order (Note [Same order on every rank]). A second call is an error.
  void MarkReady(int32_t tensor);
  // End of backward: every tensor counts as ready, every block is released
  // (phase 2). Idempotent within an iteration.
  void Flush();
  // Block until every block covering `tensor` (or every block) is reduced.
  // Throw SchedulerError on failure, on timeout, or after Shutdown.
  void WaitTensor(int32_t tensor, std::chrono::milliseconds timeout);
  void WaitAll(std::chrono::milliseconds timeout);
  // Block until every block released so far is done (launched, and its
  // collective finished), whatever is still unreleased: what a backward
  // interrupted before its flush leaves in flight, which every rank must
  // finish before it stops launching (Note [Interrupted backward] in
  // dcredit_opt/optimizer/core.py). Returns at once when none is in flight,
  // even after a failure or Shutdown; otherwise throws as WaitAll.
  void WaitReleased(std::chrono::milliseconds timeout);
  bool TensorDone(int32_t tensor);
  bool Idle();  // no iteration open, or every block of it done
  // Stop flag, wake everyone, join the thread; pending waits fail.
  void Shutdown();

  std::vector<BlockTrace> Trace();
  std::vector<int64_t> ReadyTimes();  // per tensor, ns; 0 = not ready
  Status status();
  int32_t num_blocks();
  int32_t num_tensors();

 private:
  struct Core;
  static void DispatchLoop(std::shared_ptr<Core> core);
  std::shared_ptr<Core> core_;
  std::mutex join_mu_;  // Shutdown may race with itself (the binding releases the GIL)
  std::thread thread_;
};

}  // namespace dcredit
