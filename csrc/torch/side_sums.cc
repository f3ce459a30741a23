#include "side_sums.h"

#include <algorithm>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "../core/scheduler.h"

namespace dcredit {

SideSums::SideSums(c10::intrusive_ptr<c10d::ProcessGroup> group) : group_(std::move(group)) {
  if (!group_) throw std::invalid_argument("SideSums needs a process group");
}

SideSums::~SideSums() { Close(); }

int64_t SideSums::Start(at::Tensor tensor) {
  if (!tensor.defined() || !tensor.device().is_cpu() || tensor.is_sparse() || !tensor.is_contiguous()) {
    throw std::invalid_argument("SideSums.start: a dense contiguous CPU tensor is summed, got another");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw SchedulerError(Status{StatusCode::kShutdown, "the side group is closed"});
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = group_->allreduce(tensors, opts);
  } catch (const std::exception& e) {
    throw SchedulerError(Status::Error(std::string("starting a sum on the side group failed: ") + e.what()));
  }
  const int64_t ticket = next_++;
  entries_.emplace(ticket, Entry{std::move(tensor), std::move(work)});
  return ticket;
}

void SideSums::Wait(int64_t ticket, std::chrono::milliseconds timeout) {
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(ticket);
    if (it == entries_.end()) return;
    work = it->second.work;
  }
  try {
    // Done already and well (the common case: the tally is waited for an iteration after it started): c10d
    // documents wait() as isCompleted() then isSuccess(), and its synchronize() as nothing for CPU tensors,
    // which are all a side sum holds; asked directly, that costs none of the wait's machinery. Anything else
    // takes wait(), which raises the collective's error as before.
    if (!(work->isCompleted() && work->isSuccess())) work->wait(std::max(timeout, std::chrono::milliseconds(1)));
  } catch (const std::exception& e) {
    if (!work->isCompleted()) {  // timed out: still in flight, and the ticket can be waited for again
      std::ostringstream m;  // the timeout in seconds, as the scheduler's own timeouts say it
      m << "a sum on the side group did not finish within " << timeout.count() / 1000.0 << " s: " << e.what();
      throw SchedulerError(Status{StatusCode::kTimeout, m.str()});
    }
    std::lock_guard<std::mutex> lock(mu_);
    entries_.erase(ticket);
    throw SchedulerError(Status::Error(e.what()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(ticket);
}

void SideSums::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  group_.reset();  // the works in flight hold what they need to finish
}

}  // namespace dcredit
