#include "server/thread_group.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace bertshard::server {
namespace {

// A long-running coordinator starts a thread per load: the finished ones must not pile up.
TEST(ThreadGroup, JoinsFinishedThreadsAtTheNextStart) {
  ThreadGroup group;
  for (int i = 0; i < 50; ++i) {
    group.Start([] {});
    // Every thread before this one had finished when it started, so it joined them all.
    ASSERT_EQ(group.Size(), 1u) << "after " << i + 1 << " threads";
    // Wait for this one to return (and say so), so that the next Start finds it finished.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (group.Running() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_EQ(group.Running(), 0u);
  }
}

TEST(ThreadGroup, KeepsRunningThreadsUntilTheyEnd) {
  ThreadGroup group;
  absl::Notification release;
  std::atomic<int> ended{0};
  for (int i = 0; i < 3; ++i) {
    group.Start([&] {
      release.WaitForNotification();
      ended.fetch_add(1);
    });
  }
  EXPECT_EQ(group.Size(), 3u);
  release.Notify();
  group.JoinAll();
  EXPECT_EQ(ended.load(), 3);
  EXPECT_EQ(group.Size(), 0u);
}

// A thread of the group may start another (a load that fails its job hands a batch queue to a new
// thread); JoinAll waits for those too.
TEST(ThreadGroup, JoinAllWaitsForThreadsStartedMeanwhile) {
  ThreadGroup group;
  std::atomic<bool> inner_ran{false};
  absl::Notification go;
  group.Start([&] {
    go.WaitForNotification();
    group.Start([&] {
      absl::SleepFor(absl::Milliseconds(50));  // still running when the outer thread returns
      inner_ran = true;
    });
  });
  go.Notify();
  group.JoinAll();
  EXPECT_TRUE(inner_ran.load());
}

}  // namespace
}  // namespace bertshard::server
