// File: server/thread_group.h
// -----------------------------------------------------------------------------
// Background threads that are joined when they end, not kept until their owner goes: the
// scheduler starts one per job load and one per batch queue it destroys off its lock, for as long
// as the coordinator runs. Each Start joins the threads that have finished since the last; JoinAll
// (the owner's shutdown) waits for the rest, including any started while it waits.
//
// Example:
//   ThreadGroup threads;
//   threads.Start([job_id] { LoadJob(job_id); });
//   ...
//   threads.JoinAll();  // before what the threads use goes away
//
// Failure model: none of its own; a thread's function must not throw.
// Thread safety: thread-safe. Start may be called from a thread of the group and under the
// caller's own locks (its lock is a leaf, and it joins only threads that have already finished).
// JoinAll must not be called from a thread of the group, nor under a lock such a thread takes.
#ifndef BERTSHARD_SERVER_THREAD_GROUP_H_
#define BERTSHARD_SERVER_THREAD_GROUP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace bertshard::server {

class ThreadGroup {
 public:
  ThreadGroup() = default;
  ~ThreadGroup() { JoinAll(); }
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  // Runs `fn` on a new thread, after joining the threads that have finished.
  void Start(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until every thread started (before or during the wait) has ended, and joins it.
  void JoinAll() ABSL_LOCKS_EXCLUDED(mu_);
  // Threads started and not yet joined (finished ones are joined at the next Start).
  size_t Size() const ABSL_LOCKS_EXCLUDED(mu_);
  // Threads whose function has not returned yet.
  size_t Running() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The threads that have finished, taken out of threads_ (joined by the caller, off the lock).
  std::vector<std::thread> TakeFinishedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> finished_ ABSL_GUARDED_BY(mu_);  // ids whose function has returned
};

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_THREAD_GROUP_H_
