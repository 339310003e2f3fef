// The shared-memory TP group on its own: ranks as threads (and, for a dead peer, a child process)
// over the real rendezvous store. Segments are made small so that every collective moves several pieces.
#include "worker/shm_group.h"

#include <ATen/ATen.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/rendezvous.h"

namespace bertshard::worker {
namespace {

// The rendezvous store, hosted on a port the system picks before any rank starts (a port found
// free and bound later could be taken in between by a test running alongside). Rank 0 uses it.
const std::string kSecret(32, 's');
c10::intrusive_ptr<HostedStore> Hosted() { return HostStore("127.0.0.1", kSecret, std::chrono::seconds(30)).value(); }

// Another rank's client of the store hosted on `port`.
c10::intrusive_ptr<c10d::Store> ClientStore(int port) {
  return ConnectStore({.master_port = port, .rank = 1, .timeout = std::chrono::seconds(30), .secret = kSecret}).value();
}

// Runs `body(rank, group)` on `size` threads that joined one group; returns each rank's failures.
std::vector<std::string> OnRanks(int size, const ShmOptions& options,
                                 const std::function<void(int, SharedMemoryGroup*, std::string*)>& body) {
  const auto hosted = Hosted();
  std::vector<std::string> failures(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto store = r == 0 ? c10::intrusive_ptr<c10d::Store>(hosted) : ClientStore(hosted->getPort());
      auto group = SharedMemoryGroup::Join(*store, "shm/test", r, size, options);
      if (!group.ok()) return void(failures[r] = std::string(group.status().message()));
      if (*group == nullptr) return void(failures[r] = "did not join (fell back)");
      body(r, group->get(), &failures[r]);
    });
  }
  for (auto& t : threads) t.join();
  return failures;
}

// Rank r's input: distinct per rank and per element, not exactly representable sums.
at::Tensor Input(int rank, std::vector<int64_t> shape, at::ScalarType dtype = at::kFloat) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return at::sin(at::arange(n, at::kFloat) * 0.37 + rank * 1.3).mul(rank + 1).view(shape).to(dtype);
}

ShmOptions Small() {
  ShmOptions o;
  o.segment_bytes = 1 << 20;  // 3 ranks: slots of ~128 KiB, so 1 MiB tensors travel in pieces
  o.timeout = std::chrono::seconds(20);
  return o;
}

// A peer process that exits is noticed within a fraction of a second, long before the timeout.
// First in this file: it forks, best done before other tests have started threads.
TEST(SharedMemoryGroup, APeerProcessThatExitsIsNoticedAtOnce) {
  ShmOptions o = Small();
  o.timeout = std::chrono::seconds(60);
  // The parent hosts the store after the fork (the child starts with no store threads in it) and
  // passes the child its port through a pipe.
  int port_pipe[2];
  ASSERT_EQ(pipe(port_pipe), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Rank 1: joins, then exits without taking part in any collective.
    close(port_pipe[1]);
    int port = 0;
    if (read(port_pipe[0], &port, sizeof(port)) != sizeof(port)) _exit(4);
    auto store = ClientStore(port);
    auto group = SharedMemoryGroup::Join(*store, "shm/test", 1, 2, o);
    _exit(group.ok() && *group ? 0 : 3);
  }
  close(port_pipe[0]);
  auto store = Hosted();
  const int port = store->getPort();
  ASSERT_EQ(write(port_pipe[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  close(port_pipe[1]);
  auto group = SharedMemoryGroup::Join(*store, "shm/test", 0, 2, o);
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_NE(*group, nullptr);
  int child_status = 0;
  ASSERT_EQ(waitpid(child, &child_status, 0), child);
  ASSERT_EQ(WEXITSTATUS(child_status), 0);
  at::Tensor t = at::ones({4});
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = (*group)->AllReduceSum(t);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("is gone"), std::string::npos) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// A first rank killed while it waits for its peers (SIGKILL: no unlink runs) leaves its segment
// file; the next start's sweep removes it, since its creator's pid is gone. Forks, so it comes early.
TEST(SweepStaleSegments, RemovesTheSegmentOfAKilledCreator) {
  const std::string dir = testing::TempDir() + "/shm_killed_creator";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ShmOptions o = Small();
    o.dir = dir;
    o.timeout = std::chrono::seconds(60);
    auto store = HostStore("127.0.0.1", kSecret, std::chrono::seconds(60));
    if (!store.ok()) _exit(3);
    (void)SharedMemoryGroup::Join(**store, "killed", 0, 2, o);  // rank 1 never comes
    _exit(4);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::filesystem::is_empty(dir) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_FALSE(std::filesystem::is_empty(dir)) << "the child made no segment";
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_FALSE(std::filesystem::is_empty(dir)) << "nothing was left behind to sweep";
  // Another user's kind of file, and a live creator's segment (this process's), stay.
  const std::string live = absl::StrCat(dir, "/bertshard-tp-", getpid(), "-1-abc");
  std::ofstream(live) << "x";
  std::ofstream(dir + "/not-ours") << "x";
  absl::StatusOr<int> removed = SweepStaleSegments(dir);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 1);
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{std::filesystem::path(live).filename().string(), "not-ours"}));
}

// Segments named for a dead pid are removed only when they are this user's regular files of this
// PID namespace (or, named the old way without a namespace, an hour old); the rest stay.
TEST(SweepStaleSegments, RemovesOnlyWhatADeadCreatorOfThisNamespaceLeft) {
  const std::string dir = testing::TempDir() + "/shm_sweep";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // A pid no process can hold: above the kernel's pid_max.
  std::ifstream pid_max_file("/proc/sys/kernel/pid_max");
  int64_t pid_max = 0;
  pid_max_file >> pid_max;
  ASSERT_GT(pid_max, 0);
  const int64_t dead = pid_max + 1;
  struct stat ns {};
  ASSERT_EQ(stat("/proc/self/ns/pid", &ns), 0);
  auto make = [&](const std::string& name) {
    std::ofstream(dir + "/" + name) << "x";
    return dir + "/" + name;
  };
  make(absl::StrCat("bertshard-tp-", dead, "-", ns.st_ino, "-1f"));          // swept
  make(absl::StrCat("bertshard-tp-", dead, "-", ns.st_ino + 1, "-1f"));      // another namespace
  make(absl::StrCat("bertshard-tp-", dead, "-2f"));                          // old name, new file
  const std::string old = make(absl::StrCat("bertshard-tp-", dead, "-3f"));  // old name, old file
  const timeval two_hours_ago[2] = {{time(nullptr) - 7200, 0}, {time(nullptr) - 7200, 0}};
  ASSERT_EQ(utimes(old.c_str(), two_hours_ago), 0);
  make(absl::StrCat("bertshard-tp-", getpid(), "-", ns.st_ino, "-4f"));  // alive
  make("bertshard-tp-notapid-5f");
  std::filesystem::create_symlink("/etc/hostname", absl::StrCat(dir, "/bertshard-tp-", dead, "-", ns.st_ino, "-6f"));
  absl::StatusOr<int> removed = SweepStaleSegments(dir);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 2);
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(dir, "/bertshard-tp-", dead, "-", ns.st_ino, "-1f")));
  EXPECT_FALSE(std::filesystem::exists(old));
  int left = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++left;
  EXPECT_EQ(left, 5);
  EXPECT_EQ(SweepStaleSegments(dir + "/missing").status().code(), absl::StatusCode::kUnavailable);
}

TEST(SharedMemoryGroup, CollectivesInPiecesEqualTheirDefinitions) {
  constexpr int kSize = 3;
  const auto failures = OnRanks(kSize, Small(), [](int rank, SharedMemoryGroup* g, std::string* fail) {
    if (g->slot_bytes() * 4 > (int64_t{1} << 20)) *fail += "the slots are not small; ";
    // All-reduce of 1 Mi floats (4 MiB): the sum in rank order, bit for bit, on every rank.
    const std::vector<int64_t> shape = {512, 2048};
    at::Tensor t = Input(rank, shape);
    if (absl::Status s = g->AllReduceSum(t); !s.ok()) return void(*fail += std::string(s.message()));
    const at::Tensor want = Input(0, shape).add(Input(1, shape)).add(Input(2, shape));
    if (!t.equal(want)) *fail += "all-reduce; ";
    // A strided (non-contiguous) tensor is reduced in place too.
    at::Tensor strided = Input(rank, {300, 64}).t();
    if (!g->AllReduceSum(strided).ok() ||
        !strided.equal(Input(0, {300, 64}).add(Input(1, {300, 64})).add(Input(2, {300, 64})).t()))
      *fail += "strided all-reduce; ";
    // All-gather along dim 0 (no copy after the transfer) and along a later dim.
    for (int64_t dim : {0, 1, -1}) {
      auto gathered = g->AllGather(Input(rank, {4, 30000, 3}), dim);
      if (!gathered.ok() ||
          !gathered->equal(at::cat({Input(0, {4, 30000, 3}), Input(1, {4, 30000, 3}), Input(2, {4, 30000, 3})}, dim)))
        *fail += absl::StrCat("all-gather dim ", dim, "; ");
    }
    // Reduce-scatter along dims 0 and 1: this rank's third of the sum.
    for (int64_t dim : {0, 1}) {
      const std::vector<int64_t> s = {6, 90000};
      auto part = g->ReduceScatter(Input(rank, s), dim);
      const at::Tensor sum = Input(0, s).add(Input(1, s)).add(Input(2, s));
      if (!part.ok() || !part->equal(sum.chunk(kSize, dim)[static_cast<size_t>(rank)]))
        *fail += absl::StrCat("reduce-scatter dim ", dim, "; ");
    }
    // bf16 sums run in float32 and round once: 256 + 1 + 1 = 258 (a bf16 running sum stays at 256).
    at::Tensor b = at::full({200000}, rank == 0 ? 256.f : 1.f).to(at::kBFloat16);
    if (!g->AllReduceSum(b).ok() || b.scalar_type() != at::kBFloat16 ||
        !b.equal(at::full({200000}, 258.f).to(at::kBFloat16)))
      *fail += "bf16 all-reduce; ";
    auto bpart = g->ReduceScatter(at::full({3, 70000}, rank == 0 ? 256.f : 1.f).to(at::kBFloat16), 0);
    if (!bpart.ok() || !bpart->equal(at::full({1, 70000}, 258.f).to(at::kBFloat16))) *fail += "bf16 reduce-scatter; ";
  });
  for (int r = 0; r < kSize; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// Ranks that cannot map the first rank's segment (here: each looks in its own directory, as on
// two hosts) all get nullptr, so that all of them use the network instead; nothing is left behind.
TEST(SharedMemoryGroup, RanksThatCannotShareASegmentAllFallBack) {
  const std::string base = testing::TempDir() + "/shm_fallback";
  std::filesystem::create_directories(base + "/a");
  std::filesystem::create_directories(base + "/b");
  const auto hosted = Hosted();
  std::vector<std::string> results(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ShmOptions o = Small();
      o.dir = base + (r == 0 ? "/a" : "/b");
      auto store = r == 0 ? c10::intrusive_ptr<c10d::Store>(hosted) : ClientStore(hosted->getPort());
      auto group = SharedMemoryGroup::Join(*store, "shm/test", r, 2, o);
      results[r] = !group.ok() ? std::string(group.status().message()) : *group ? "joined" : "fell back";
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(results[0], "fell back");
  EXPECT_EQ(results[1], "fell back");
  EXPECT_TRUE(std::filesystem::is_empty(base + "/a")) << "the segment file was left behind";
}

TEST(SharedMemoryGroup, TheSegmentFileIsGoneOnceEveryRankJoined) {
  ShmOptions o = Small();
  o.dir = testing::TempDir() + "/shm_unlinked";
  std::filesystem::create_directories(o.dir);
  const auto failures = OnRanks(2, o, [&](int, SharedMemoryGroup*, std::string* fail) {
    if (!std::filesystem::is_empty(o.dir)) *fail += "segment file still there after Join; ";
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// Different collectives (or sizes) on the ranks are an error on every rank, never garbage; the
// group is broken afterwards.
TEST(SharedMemoryGroup, MismatchedCallsFailOnEveryRank) {
  const auto failures = OnRanks(2, Small(), [](int rank, SharedMemoryGroup* g, std::string* fail) {
    at::Tensor t = at::ones({rank == 0 ? 10 : 12});
    const absl::Status s = g->AllReduceSum(t);
    if (s.code() != absl::StatusCode::kInternal || s.message().find("different collectives") == std::string::npos)
      *fail += absl::StrCat("mismatch gave: ", s.ToString(), "; ");
    at::Tensor u = at::ones({4});
    if (g->AllReduceSum(u).code() != absl::StatusCode::kUnavailable) *fail += "group not broken after the error; ";
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// A peer that never arrives: the wait ends at the timeout with UNAVAILABLE, not a hang.
TEST(SharedMemoryGroup, AMissingPeerTimesOutAsUnavailable) {
  ShmOptions o = Small();
  o.timeout = std::chrono::milliseconds(700);
  const auto failures = OnRanks(2, o, [](int rank, SharedMemoryGroup* g, std::string* fail) {
    if (rank == 1) return std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    at::Tensor t = at::ones({4});
    const auto start = std::chrono::steady_clock::now();
    const absl::Status s = g->AllReduceSum(t);
    const auto waited = std::chrono::steady_clock::now() - start;
    if (s.code() != absl::StatusCode::kUnavailable) *fail += "not UNAVAILABLE: " + s.ToString();
    if (waited < std::chrono::milliseconds(600) || waited > std::chrono::milliseconds(1400))
      *fail += absl::StrCat("waited ", std::chrono::duration<double>(waited).count(), " s; ");
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// A first rank whose peer never answers (it died before joining) leaves no segment file behind:
// otherwise every such failure keeps its segment's pages in /dev/shm until the host reboots.
TEST(SharedMemoryGroup, TheSegmentFileIsGoneWhenAPeerNeverAnswers) {
  ShmOptions o = Small();
  o.dir = testing::TempDir() + "/shm_peer_gone";
  std::filesystem::create_directories(o.dir);
  const auto store = HostStore("127.0.0.1", kSecret, std::chrono::milliseconds(1500)).value();
  const auto group = SharedMemoryGroup::Join(*store, "gone", 0, 2, o);
  EXPECT_EQ(group.status().code(), absl::StatusCode::kUnavailable) << group.status();
  EXPECT_TRUE(std::filesystem::is_empty(o.dir)) << "segment file left behind in " << o.dir;
}

TEST(SharedMemoryGroup, BadSizesAreInvalidArguments) {
  auto store = Hosted();
  EXPECT_EQ(SharedMemoryGroup::Join(*store, "p", 0, 1, ShmOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedMemoryGroup::Join(*store, "p", 2, 2, ShmOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
  ShmOptions tiny;
  tiny.segment_bytes = 100000;
  EXPECT_EQ(SharedMemoryGroup::Join(*store, "p", 0, 2, tiny).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace bertshard::worker
