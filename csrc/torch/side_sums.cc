#include "side_sums.h"

#include <algorithm>
#include <exception>
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
  std::lock_guard<std::mutex> closing(close_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_) throw SchedulerError(Status{StatusCode::kShutdown, "the side group is closed"});
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
  const int64_t ticket = next_++;
  entries_[ticket].tensor = std::move(tensor);
  queue_.push_back(ticket);
  queued_.notify_one();
  return ticket;
}

void SideSums::Loop() {
  NameThisThread("dc_side");
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    queued_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopped, and every queued sum started
    const int64_t ticket = queue_.front();
    queue_.pop_front();
    std::vector<at::Tensor> tensors{entries_.at(ticket).tensor};
    starting_ = true;
    lock.unlock();
    c10::intrusive_ptr<c10d::Work> work;
    std::string error;
    try {
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      work = group_->allreduce(tensors, opts);
    } catch (const std::exception& e) {
      error = std::string("starting a sum on the side group failed: ") + e.what();
    }
    lock.lock();
    Entry& entry = entries_.at(ticket);  // only Wait erases, and only a started entry
    entry.started = true;
    entry.work = std::move(work);
    entry.error = std::move(error);
    starting_ = false;
    changed_.notify_all();
  }
}

void SideSums::Wait(int64_t ticket, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = entries_.find(ticket);
    if (it == entries_.end()) return;
    if (!changed_.wait_until(lock, deadline, [&] { return it->second.started; })) {
      throw SchedulerError(Status{StatusCode::kTimeout, "a sum on the side group was not started within " +
                                                            std::to_string(timeout.count()) + " ms"});
    }
    if (!it->second.error.empty()) {
      std::string error = std::move(it->second.error);
      entries_.erase(it);
      throw SchedulerError(Status::Error(error));
    }
    work = it->second.work;
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  try {
    work->wait(std::max(left, std::chrono::milliseconds(1)));
  } catch (const std::exception& e) {
    if (!work->isCompleted()) {  // timed out: still in flight, and the ticket can be waited for again
      throw SchedulerError(Status{StatusCode::kTimeout, "a sum on the side group did not finish within " +
                                                            std::to_string(timeout.count()) + " ms: " + e.what()});
    }
    std::lock_guard<std::mutex> lock(mu_);
    entries_.erase(ticket);
    throw SchedulerError(Status::Error(e.what()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(ticket);
}

void SideSums::Drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!changed_.wait_for(lock, timeout, [this] { return queue_.empty() && !starting_; })) {
    throw SchedulerError(Status{StatusCode::kTimeout, "the side group's queued sums were not started within " +
                                                          std::to_string(timeout.count()) + " ms"});
  }
}

void SideSums::Close() {
  std::lock_guard<std::mutex> closing(close_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    queued_.notify_one();
  }
  if (thread_.joinable()) thread_.join();  // it only starts sums, each at once: it is never held up long
  group_.reset();
}

}  // namespace dcredit
