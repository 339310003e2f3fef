#include "server/thread_group.h"

#include <algorithm>
#include <utility>

namespace bertshard::server {

std::vector<std::thread> ThreadGroup::TakeFinishedLocked() {
  std::vector<std::thread> done;
  for (uint64_t id : finished_) {
    auto it = threads_.find(id);
    if (it == threads_.end()) continue;  // joined by JoinAll already
    done.push_back(std::move(it->second));
    threads_.erase(it);
  }
  finished_.clear();
  return done;
}

void ThreadGroup::Start(std::function<void()> fn) {
  std::vector<std::thread> done;
  {
    absl::MutexLock lock(&mu_);
    done = TakeFinishedLocked();
    const uint64_t id = next_id_++;
    // The thread marks itself finished under mu_, so it cannot do so before it is in threads_.
    // `fn` and what it holds are destroyed before the thread says it has finished, so joining a
    // finished thread never waits on a destructor (which might take a lock the joiner holds).
    threads_[id] = std::thread([this, id, fn = std::move(fn)]() mutable {
      fn();
      fn = nullptr;
      absl::MutexLock done_lock(&mu_);
      finished_.push_back(id);
    });
  }
  // Finished: each has at most the return from its lambda left, so these joins do not wait.
  for (std::thread& t : done) t.join();
}

void ThreadGroup::JoinAll() {
  while (true) {
    std::vector<std::thread> all;
    {
      absl::MutexLock lock(&mu_);
      if (threads_.empty()) {
        finished_.clear();
        return;
      }
      for (auto& [id, t] : threads_) all.push_back(std::move(t));
      threads_.clear();
    }
    for (std::thread& t : all) t.join();
  }
}

size_t ThreadGroup::Size() const {
  absl::MutexLock lock(&mu_);
  return threads_.size();
}

size_t ThreadGroup::Running() const {
  absl::MutexLock lock(&mu_);
  size_t running = 0;
  for (const auto& [id, thread] : threads_) {
    running += std::find(finished_.begin(), finished_.end(), id) == finished_.end() ? 1 : 0;
  }
  return running;
}

}  // namespace bertshard::server
