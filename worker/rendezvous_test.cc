// Real rendezvous stores on loopback: hosted, connected to, refused, timed out, and the barrier and
// reservations built on them. Ranks are threads of this process.
#include "worker/rendezvous.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace bertshard::worker {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

const std::string kSecret(32, 's');  // the job's rendezvous secret
const std::string kOtherSecret(32, 'o');

TEST(Rendezvous, RankZeroHostsOnMasterPortAndTheOthersConnect) {
  // A port known to be free for this test: one a hosted store held, closed before the ranks start.
  int port = 0;
  {
    auto probe = HostStore("127.0.0.1", kSecret, seconds(5));
    ASSERT_TRUE(probe.ok()) << probe.status();
    port = (*probe)->getPort();
  }
  RendezvousOptions options{.master_port = port, .rank = 0, .world_size = 2, .timeout = seconds(10), .secret = kSecret};
  auto host = ConnectStore(options);
  ASSERT_TRUE(host.ok()) << host.status();
  options.rank = 1;
  auto peer = ConnectStore(options);
  ASSERT_TRUE(peer.ok()) << peer.status();
  (*host)->set("from-0", std::vector<uint8_t>{7});
  EXPECT_EQ((*peer)->get("from-0"), std::vector<uint8_t>{7});
}

// A store made beforehand (ReservePort's) is used as it is, with the job's timeout, instead of
// hosting one on master_port: the peers reach it on its own port.
TEST(Rendezvous, AHandedStoreIsUsedWithTheJobsTimeout) {
  auto hosted = HostStore("127.0.0.1", kSecret, seconds(30));
  ASSERT_TRUE(hosted.ok()) << hosted.status();
  const int port = (*hosted)->getPort();
  auto store = ConnectStore({.master_port = port,
                             .rank = 0,
                             .world_size = 2,
                             .timeout = milliseconds(500),
                             .secret = kSecret,
                             .store = c10::intrusive_ptr<c10d::Store>(*hosted)});
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(store->get(), hosted->get());
  EXPECT_EQ((*store)->getTimeout(), milliseconds(500));
  auto peer =
      ConnectStore({.master_port = port, .rank = 1, .world_size = 2, .timeout = seconds(10), .secret = kSecret});
  ASSERT_TRUE(peer.ok()) << peer.status();
  (*peer)->set("from-1", std::vector<uint8_t>{1});
  EXPECT_EQ((*store)->get("from-1"), std::vector<uint8_t>{1});
}

TEST(Rendezvous, HostingATakenPortIsUnavailableNamingTheAddress) {
  auto taken = HostStore("127.0.0.1", kSecret, seconds(5));
  ASSERT_TRUE(taken.ok()) << taken.status();
  auto store = ConnectStore(
      {.master_port = (*taken)->getPort(), .rank = 0, .world_size = 2, .timeout = seconds(5), .secret = kSecret});
  EXPECT_EQ(store.status().code(), absl::StatusCode::kUnavailable) << store.status();
  EXPECT_NE(store.status().message().find(absl::StrCat("rendezvous at 127.0.0.1:", (*taken)->getPort())),
            std::string::npos)
      << store.status();
}

TEST(Rendezvous, NoHostWithinTheTimeoutIsUnavailable) {
  int port = 0;
  {
    auto probe = HostStore("127.0.0.1", kSecret, seconds(5));
    ASSERT_TRUE(probe.ok()) << probe.status();
    port = (*probe)->getPort();
  }
  const auto start = std::chrono::steady_clock::now();
  auto store =
      ConnectStore({.master_port = port, .rank = 1, .world_size = 2, .timeout = milliseconds(1000), .secret = kSecret});
  EXPECT_EQ(store.status().code(), absl::StatusCode::kUnavailable) << store.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(20));
}

// The gate opens only when the last rank arrives: the first two have counted themselves in and
// still wait (they cannot have returned before the gate is set), then all three return.
TEST(StoreBarrier, ReturnsOnceEveryRankHasArrived) {
  auto hosted = HostStore("127.0.0.1", kSecret, seconds(30));
  ASSERT_TRUE(hosted.ok()) << hosted.status();
  const int port = (*hosted)->getPort();
  std::atomic<int> returned{0};
  std::vector<absl::Status> results(3);
  auto arrive = [&](int rank) {
    // Rank 0 is handed the hosted store (as a worker's ReservePort hands it), the others connect.
    auto store = ConnectStore(
        {.master_port = port,
         .rank = rank,
         .world_size = 3,
         .timeout = seconds(30),
         .secret = kSecret,
         .store = rank == 0 ? c10::intrusive_ptr<c10d::Store>(*hosted) : c10::intrusive_ptr<c10d::Store>()});
    results[rank] = store.ok() ? StoreBarrier(**store, "loaded", 3) : store.status();
    ++returned;
  };
  std::vector<std::thread> early;
  for (int rank = 1; rank <= 2; ++rank) early.emplace_back(arrive, rank);
  // Both have counted themselves in: an event on the store, not a sleep.
  (*hosted)->wait({"loaded/arrived"});
  while ((*hosted)->add("loaded/arrived", 0) < 2) std::this_thread::sleep_for(milliseconds(10));
  EXPECT_FALSE((*hosted)->check({"loaded/open"}));
  EXPECT_EQ(returned.load(), 0);
  arrive(0);
  for (auto& t : early) t.join();
  EXPECT_EQ(returned.load(), 3);
  for (int rank = 0; rank < 3; ++rank) EXPECT_TRUE(results[rank].ok()) << rank << ": " << results[rank];
}

TEST(StoreBarrier, AMissingPeerIsUnavailableAfterTheStoresTimeout) {
  auto hosted = HostStore("127.0.0.1", kSecret, milliseconds(1500));
  ASSERT_TRUE(hosted.ok()) << hosted.status();
  const absl::Status status = StoreBarrier(**hosted, "never", 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find("barrier never failed"), std::string::npos) << status;
}

TEST(ReservedStores, AReservationIsClaimedOnceByItsJobOnly) {
  ReservedStores reserved(absl::Minutes(5), "127.0.0.1");
  auto port = reserved.Reserve("job-a", kSecret);
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_FALSE(reserved.Claim("job-b", *port, kSecret).defined());      // another job's: left for job-a's rank 0
  EXPECT_FALSE(reserved.Claim("job-a", *port + 1, kSecret).defined());  // nothing reserved there
  c10::intrusive_ptr<c10d::Store> store = reserved.Claim("job-a", *port, kSecret);
  ASSERT_TRUE(store.defined());
  EXPECT_FALSE(reserved.Claim("job-a", *port, kSecret).defined());  // handed over already
  // The claimed store serves the reserved port: a peer meets it there.
  auto peer =
      ConnectStore({.master_port = *port, .rank = 1, .world_size = 2, .timeout = seconds(10), .secret = kSecret});
  ASSERT_TRUE(peer.ok()) << peer.status();
  (*peer)->set("k", std::vector<uint8_t>{3});
  EXPECT_EQ(store->get("k"), std::vector<uint8_t>{3});
  // Reserved for no job in particular: any job may claim it.
  auto any = reserved.Reserve("", kSecret);
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_NE(*any, *port);
  EXPECT_TRUE(reserved.Claim("job-z", *any, kSecret).defined());
}

// A reservation made for one load attempt is not handed to another attempt of the same job (whose
// ranks hold another secret and could not join it), and its port refuses the other secret.
TEST(ReservedStores, AReservationIsClaimedOnlyWithItsSecret) {
  ReservedStores reserved(absl::Minutes(5), "127.0.0.1");
  auto port = reserved.Reserve("job-a", kSecret);
  ASSERT_TRUE(port.ok()) << port.status();
  EXPECT_FALSE(reserved.Claim("job-a", *port, kOtherSecret).defined());
  auto stranger =
      ConnectStore({.master_port = *port, .rank = 1, .world_size = 2, .timeout = seconds(10), .secret = kOtherSecret});
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kPermissionDenied) << stranger.status();
  EXPECT_TRUE(reserved.Claim("job-a", *port, kSecret).defined());
  EXPECT_EQ(reserved.Reserve("job-b", "short").status().code(), absl::StatusCode::kInvalidArgument);
}

// The rank that does not know the job's secret reads and writes nothing: refused at once.
TEST(Rendezvous, ARankWithoutTheSecretIsRefusedAtOnce) {
  auto hosted = HostStore("127.0.0.1", kSecret, seconds(30));
  ASSERT_TRUE(hosted.ok()) << hosted.status();
  (*hosted)->set("world/0", std::vector<uint8_t>{1});
  const auto start = std::chrono::steady_clock::now();
  auto stranger = ConnectStore({.master_port = (*hosted)->getPort(),
                                .rank = 1,
                                .world_size = 2,
                                .timeout = seconds(30),
                                .secret = kOtherSecret});
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kPermissionDenied) << stranger.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(10));
  EXPECT_EQ((*hosted)->getNumKeys(), 1);
  // Refused by the server, not only by the client's check of the server's proof.
  EXPECT_EQ((*hosted)->server().stats().authenticated, 0);
  EXPECT_EQ((*hosted)->server().stats().refused, 1);
}

TEST(ReservedStores, AnUnclaimedReservationExpires) {
  ReservedStores reserved(absl::Milliseconds(200), "127.0.0.1");
  auto port = reserved.Reserve("job-a", kSecret);
  ASSERT_TRUE(port.ok()) << port.status();
  // Expired (closed by the expirer) within a deadline: waited for, not slept on.
  const auto deadline = std::chrono::steady_clock::now() + seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    auto peer = ConnectStore(
        {.master_port = *port, .rank = 1, .world_size = 2, .timeout = milliseconds(1500), .secret = kSecret});
    if (!peer.ok()) break;  // nothing serves the port any more
    std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_LT(std::chrono::steady_clock::now(), deadline);
  EXPECT_FALSE(reserved.Claim("job-a", *port, kSecret).defined());
}

}  // namespace
}  // namespace bertshard::worker
