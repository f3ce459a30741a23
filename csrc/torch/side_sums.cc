#include "side_sums.h"

#include <exception>
#include <vector>

#include "../core/scheduler.h"

namespace dcredit {

SideSums::SideSums(c10::intrusive_ptr<c10d::ProcessGroup> group)
    : state_(std::make_shared<State>()), group_(std::move(group)) {
  if (!group_) throw std::invalid_argument("SideSums needs a process group");
}

SideSums::~SideSums() { Close(); }

int64_t SideSums::Start(at::Tensor tensor) {
  if (!tensor.defined() || !tensor.device().is_cpu() || tensor.is_sparse() || !tensor.is_contiguous()) {
    throw std::invalid_argument("SideSums.start: a dense contiguous CPU tensor is summed, got another");
  }
  std::lock_guard<std::mutex> closing(close_mu_);
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->stop) throw SchedulerError(Status{StatusCode::kShutdown, "the side group is closed"});
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
  const int64_t ticket = state_->next++;
  state_->entries.emplace(ticket, Entry{});
  state_->queue.emplace_back(ticket, std::move(tensor));
  state_->queued.notify_one();
  return ticket;
}

void SideSums::Finish(State& state, int64_t ticket, const std::string* error) {
  std::lock_guard<std::mutex> lock(state.mu);
  auto it = state.entries.find(ticket);
  if (it != state.entries.end()) {
    it->second.done = true;
    if (error != nullptr) it->second.error = error->empty() ? "the collective failed" : *error;
  }
  state.changed.notify_all();
}

void SideSums::Loop() {
  NameThisThread("dc_side");
  State& state = *state_;
  std::unique_lock<std::mutex> lock(state.mu);
  while (true) {
    state.queued.wait(lock, [&state] { return state.stop || !state.queue.empty(); });
    if (state.queue.empty()) return;  // stopped, and every queued sum started
    auto [ticket, tensor] = std::move(state.queue.front());
    state.queue.pop_front();
    state.starting = true;
    lock.unlock();
    c10::intrusive_ptr<c10d::Work> work;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    std::string error;
    bool failed = false;
    try {
      std::vector<at::Tensor> tensors{tensor};
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      work = group_->allreduce(tensors, opts);
      try {
        future = work->getFuture();
      } catch (const c10::Error&) {  // Note [Works without a future] in torch_backend.cc: wait here
        work->wait();
      }
    } catch (const std::exception& e) {
      error = e.what();
      failed = true;
    }
    if (future) {
      // Runs at once, on this thread, where the sum is already done (no lock held here).
      future->addCallback([state = state_, ticket = ticket, tensor = tensor](c10::ivalue::Future& fut) {
        if (fut.hasError()) {
          const std::string message = fut.tryRetrieveErrorMessage();
          Finish(*state, ticket, &message);
        } else {
          Finish(*state, ticket, nullptr);
        }
      });
    } else {
      Finish(state, ticket, failed ? &error : nullptr);
    }
    work.reset();
    future.reset();
    lock.lock();
    state.starting = false;
    state.changed.notify_all();
  }
}

void SideSums::Wait(int64_t ticket, std::chrono::milliseconds timeout) {
  State& state = *state_;
  std::unique_lock<std::mutex> lock(state.mu);
  auto it = state.entries.find(ticket);
  if (it == state.entries.end()) return;
  if (!state.changed.wait_for(lock, timeout, [&] { return it->second.done; })) {
    throw SchedulerError(Status{StatusCode::kTimeout, "a sum on the side group did not finish within " +
                                                          std::to_string(timeout.count()) + " ms"});
  }
  std::string error = std::move(it->second.error);
  state.entries.erase(it);
  if (!error.empty()) throw SchedulerError(Status::Error(error));
}

void SideSums::Drain(std::chrono::milliseconds timeout) {
  State& state = *state_;
  std::unique_lock<std::mutex> lock(state.mu);
  if (!state.changed.wait_for(lock, timeout, [&] { return state.queue.empty() && !state.starting; })) {
    throw SchedulerError(Status{StatusCode::kTimeout, "the side group's queued sums were not started within " +
                                                          std::to_string(timeout.count()) + " ms"});
  }
}

void SideSums::Close() {
  std::lock_guard<std::mutex> closing(close_mu_);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
    state_->queued.notify_one();
  }
  if (thread_.joinable()) thread_.join();  // it starts what is queued, never waits on the network for long
  group_.reset();
}

}  // namespace dcredit
