#include "backends.h"

namespace dcredit {

void ManualBackend::Launch(int32_t block, int32_t channel, Done done) {
  std::lock_guard<std::mutex> lock(mu_);
  Launched launched{block, channel, std::move(next_behind_)};
  next_behind_.clear();
  pending_.push_back({launched, std::move(done)});
  history_.push_back(std::move(launched));
  cv_.notify_one();
}

void ManualBackend::SetOrdersOnDevice(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  orders_on_device_ = on;
}

bool ManualBackend::CanOrderAfter(int32_t block) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!orders_on_device_) return false;
  for (const Launched& l : history_) {
    if (l.block == block) return true;
  }
  return false;
}

void ManualBackend::OrderNextAfter(const std::vector<int32_t>& blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  next_behind_ = blocks;
}

bool ManualBackend::NextLaunch(std::chrono::milliseconds timeout, Launched* out) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return closed_ || taken_ < history_.size(); }) || closed_) return false;
  *out = history_[taken_++];
  return true;
}

void ManualBackend::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  cv_.notify_all();
}

std::vector<ManualBackend::Launched> ManualBackend::Pending() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Launched> out;
  out.reserve(pending_.size());
  for (const auto& p : pending_) out.push_back(p.first);
  return out;
}

std::vector<ManualBackend::Launched> ManualBackend::History() {
  std::lock_guard<std::mutex> lock(mu_);
  return history_;
}

bool ManualBackend::Complete(int32_t block, Status status) {
  Done done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->first.block == block) {
        done = std::move(it->second);
        pending_.erase(it);
        break;
      }
    }
  }
  if (!done) return false;
  done(std::move(status));  // outside our lock: the scheduler takes its own
  return true;
}

void ManualBackend::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.clear();
  history_.clear();
  next_behind_.clear();
  taken_ = 0;
}

}  // namespace dcredit
