// The authenticated rendezvous store on loopback: real sockets, clients as threads of this
// process, strangers as raw sockets speaking out of turn.
#include "worker/auth_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "worker/auth_store_wire.h"

namespace bertshard::worker {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

const std::string kSecret = "0123456789abcdef0123456789abcdef";
const std::string kOtherSecret = "fedcba9876543210fedcba9876543210";

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

c10::intrusive_ptr<HostedStore> Host(AuthStoreServerOptions options = {}) {
  if (options.secret.empty()) options.secret = kSecret;
  auto hosted = HostedStore::Start(std::move(options));
  EXPECT_TRUE(hosted.ok()) << hosted.status();
  return hosted.ok() ? *hosted : c10::intrusive_ptr<HostedStore>();
}

absl::StatusOr<c10::intrusive_ptr<AuthStoreClient>> Join(int port, const std::string& secret = kSecret,
                                                         milliseconds timeout = seconds(10),
                                                         AuthStoreLimits limits = {}) {
  return AuthStoreClient::Connect(
      {.host = "127.0.0.1", .port = port, .secret = secret, .timeout = timeout, .limits = limits});
}

// A raw TCP connection to 127.0.0.1:port (or -1).
int RawConnect(int port, const char* address = "127.0.0.1") {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, address, &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Everything the server sends on `fd` until it closes (or 5 s pass).
std::string ReadUntilClosed(int fd) {
  std::string all;
  const auto deadline = Clock::now() + seconds(5);
  while (Clock::now() < deadline) {
    absl::StatusOr<std::string> byte = wire::ReadExactly(fd, 1, deadline);
    if (!byte.ok()) break;
    all += *byte;
  }
  return all;
}

template <typename F>
absl::Status Thrown(F&& f) {
  try {
    f();
    return absl::OkStatus();
  } catch (const AuthStoreError& e) {
    return absl::Status(e.code(), e.what());
  }
}

// Waits (bounded) for `done` to hold.
template <typename F>
bool Eventually(F&& done, milliseconds within = seconds(10)) {
  const auto deadline = Clock::now() + within;
  while (Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return done();
}

TEST(AuthStore, ClientAndHostShareEveryOperation) {
  auto host = Host();
  auto client = Join(host->getPort());
  ASSERT_TRUE(client.ok()) << client.status();
  auto& c = **client;
  c.set("a", Bytes("one"));
  EXPECT_EQ(host->get("a"), Bytes("one"));
  host->set("b", Bytes("two"));
  EXPECT_EQ(c.get("b"), Bytes("two"));
  EXPECT_EQ(c.add("n", 2), 2);
  EXPECT_EQ(host->add("n", 3), 5);
  EXPECT_EQ(c.get("n"), Bytes("5"));  // counters are decimal text, as TCPStore's
  EXPECT_EQ(c.compareSet("a", Bytes("one"), Bytes("uno")), Bytes("uno"));
  EXPECT_EQ(c.compareSet("a", Bytes("one"), Bytes("eins")), Bytes("uno"));  // not the expected: unchanged
  EXPECT_EQ(c.compareSet("new", Bytes(""), Bytes("made")), Bytes("made"));
  EXPECT_TRUE(c.check({"a", "b", "n"}));
  EXPECT_FALSE(c.check({"a", "absent"}));
  EXPECT_EQ(c.getNumKeys(), 4);
  EXPECT_TRUE(c.deleteKey("new"));
  EXPECT_FALSE(c.deleteKey("new"));
  EXPECT_EQ(host->getNumKeys(), 3);
  // A get waits for its key: set by the host a little later.
  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(100));
    host->set("late", Bytes("here"));
  });
  EXPECT_EQ(c.get("late"), Bytes("here"));
  later.join();
  c.wait({"a", "late"});
  EXPECT_EQ(host->server().stats().authenticated, 1);
}

// A world of 128 ranks meets through one store, all connecting at once (more handshakes than the
// 64 held at a time: a dropped one is retried), each publishing 16 KiB (a Gloo full mesh's address
// list at this size is a few KiB) and reading its neighbours'.
TEST(AuthStore, AWorldOf128MeetsThroughOneStore) {
  constexpr int kWorld = 128;
  auto host = Host();
  std::vector<std::string> failures(kWorld);
  std::vector<std::thread> ranks;
  const auto start = Clock::now();
  for (int rank = 1; rank < kWorld; ++rank) {
    ranks.emplace_back([&, rank] {
      auto client = Join(host->getPort(), kSecret, seconds(60));
      if (!client.ok()) return void(failures[rank] = std::string(client.status().message()));
      const absl::Status s = Thrown([&] {
        (*client)->set("rank/" + std::to_string(rank), std::vector<uint8_t>(16 << 10, static_cast<uint8_t>(rank)));
        const int next = (rank + 1) % kWorld;
        if ((*client)->get("rank/" + std::to_string(next)) !=
            std::vector<uint8_t>(16 << 10, static_cast<uint8_t>(next)))
          failures[rank] = "wrong neighbour value";
      });
      if (!s.ok()) failures[rank] = std::string(s.message());
    });
  }
  host->set("rank/0", std::vector<uint8_t>(16 << 10, 0));
  for (auto& t : ranks) t.join();
  for (int rank = 1; rank < kWorld; ++rank) EXPECT_EQ(failures[rank], "") << "rank " << rank;
  EXPECT_EQ(host->getNumKeys(), kWorld);
  // Some may have been dropped mid-handshake and come back: at least one pass each.
  EXPECT_GE(host->server().stats().authenticated, kWorld - 1);
  std::printf("%d ranks met in %.0f ms\n", kWorld,
              std::chrono::duration<double, std::milli>(Clock::now() - start).count());
}

TEST(AuthStore, AWrongSecretIsRefusedAtOnceAndReadsNothing) {
  auto host = Host();
  host->set("world/0", Bytes("gloo address"));
  const auto start = Clock::now();
  auto stranger = Join(host->getPort(), kOtherSecret, seconds(30));
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kPermissionDenied) << stranger.status();
  EXPECT_LT(Clock::now() - start, seconds(5));  // refused, not retried until the timeout
  EXPECT_FALSE(absl::StrContains(stranger.status().message(), kSecret));
  EXPECT_EQ(host->server().stats().refused, 1);
  EXPECT_EQ(host->server().stats().authenticated, 0);
  EXPECT_EQ(Join(host->getPort(), "too short").status().code(), absl::StatusCode::kInvalidArgument);
}

// A stranger who speaks TCPStore's protocol (or anything else) gets the greeting and a refusal:
// never a stored value, and nothing it writes is stored.
TEST(AuthStore, AStrangerSpeakingAnotherProtocolGetsNoValueAndSetsNoKey) {
  auto host = Host();
  host->set("shm/tp0/segment", Bytes("bertshard-tp-1-abc\n12345"));
  const int fd = RawConnect(host->getPort());
  ASSERT_GE(fd, 0);
  // TCPStore's SET of "world/0/1" then GET of the segment key, as 1.13's client would send them.
  std::string query;
  auto put = [&](const std::string& s) {
    const uint64_t n = s.size();
    query.append(reinterpret_cast<const char*>(&n), 8);
    query += s;
  };
  query.push_back(0);  // SET
  put("world/0/1");
  put(std::string(100000, 'x'));
  query.push_back(1);  // GET
  put("shm/tp0/segment");
  (void)!write(fd, query.data(), query.size());
  const std::string answer = ReadUntilClosed(fd);
  close(fd);
  EXPECT_EQ(answer.substr(0, 8), wire::kServerMagic);
  EXPECT_LE(answer.size(), wire::kServerHelloBytes + 1) << "the server said more than its greeting and verdict";
  EXPECT_FALSE(absl::StrContains(answer, "bertshard-tp-1-abc"));
  EXPECT_FALSE(host->check({"world/0/1"}));
  EXPECT_EQ(host->getNumKeys(), 1);
  EXPECT_TRUE(Eventually([&] { return host->server().stats().refused == 1 && host->server().stats().pending == 0; }));
}

TEST(AuthStore, OversizedKeysAndValuesAreRefusedAndTheConnectionKeepsWorking) {
  AuthStoreLimits small{.max_key_bytes = 16, .max_value_bytes = 1024, .max_keys = 4, .max_total_bytes = 4096};
  auto host = Host({.limits = small});
  // A client that believes in larger limits: the server refuses on its own.
  auto client = Join(host->getPort(), kSecret, seconds(10), AuthStoreLimits{});
  ASSERT_TRUE(client.ok()) << client.status();
  auto& c = **client;
  absl::Status s = Thrown([&] { c.set("k", std::vector<uint8_t>(2048, 1)); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "exceeds the limit of 1024 bytes")) << s;
  s = Thrown([&] { c.set(std::string(17, 'k'), Bytes("v")); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  // Keys held and bytes held are bounded too.
  for (int i = 0; i < 4; ++i) c.set("k" + std::to_string(i), std::vector<uint8_t>(100, 1));
  s = Thrown([&] { c.set("k4", Bytes("v")); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  s = Thrown([&] { c.set("k0", std::vector<uint8_t>(1000, 1)); });  // fine alone, not within 4096 with the rest
  EXPECT_EQ(s.code(), absl::StatusCode::kOk) << s;
  for (int i = 1; i < 4; ++i) {
    s = Thrown([&] { c.set("k" + std::to_string(i), std::vector<uint8_t>(1000, 1)); });
    if (!s.ok()) break;
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_LE(host->server().stats().bytes, 4096);
  c.set("k1", Bytes("ok"));  // still connected
  EXPECT_EQ(host->get("k1"), Bytes("ok"));
  // The client checks its own limits before sending.
  auto strict = Join(host->getPort(), kSecret, seconds(10), small);
  ASSERT_TRUE(strict.ok());
  s = Thrown([&] { (*strict)->set("k", std::vector<uint8_t>(2048, 1)); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
}

// A member that announces a frame larger than any request may be is cut off before the server
// reads (or allocates) it.
// A raw connection to 127.0.0.1:port that has passed the handshake with kSecret; -1 if it did not.
int RawAuthenticated(int port) {
  const int fd = RawConnect(port);
  if (fd < 0) return -1;
  const auto deadline = Clock::now() + seconds(5);
  absl::StatusOr<std::string> hello = wire::ReadExactly(fd, wire::kServerHelloBytes, deadline);
  const std::string client_nonce(wire::kNonceBytes, 'n');
  if (hello.ok()) {
    const std::string proof = wire::HandshakeMac(kSecret, "client", hello->substr(8), client_nonce);
    if (wire::WriteAll(fd, std::string(wire::kClientMagic) + client_nonce + proof, deadline).ok()) {
      absl::StatusOr<std::string> verdict = wire::ReadExactly(fd, 1 + wire::kMacBytes, deadline);
      if (verdict.ok() && (*verdict)[0] == wire::kAccepted) return fd;
    }
  }
  close(fd);
  return -1;
}

TEST(AuthStore, AnOversizedFrameClosesTheConnectionUnread) {
  auto host = Host();
  const int fd = RawAuthenticated(host->getPort());
  ASSERT_GE(fd, 0);
  const auto deadline = Clock::now() + seconds(5);
  const uint32_t huge = 1u << 30;
  ASSERT_TRUE(wire::WriteAll(fd, std::string(reinterpret_cast<const char*>(&huge), 4), deadline).ok());
  EXPECT_EQ(ReadUntilClosed(fd), "");
  close(fd);
  EXPECT_EQ(host->getNumKeys(), 0);
  EXPECT_TRUE(Eventually([&] { return host->server().stats().clients == 0; }));
}

TEST(AuthStore, AHandshakeThatNeverComesFreesItsSlot) {
  auto host = Host({.handshake_timeout = milliseconds(300), .max_pending = 1});
  const auto start = Clock::now();
  const int silent = RawConnect(host->getPort());
  ASSERT_GE(silent, 0);
  ASSERT_TRUE(Eventually([&] { return host->server().stats().pending == 1; }));
  EXPECT_TRUE(Eventually([&] { return host->server().stats().pending == 0; }));
  EXPECT_GE(Clock::now() - start, milliseconds(250));
  EXPECT_EQ(host->server().stats().refused, 1);
  close(silent);
  auto client = Join(host->getPort());
  EXPECT_TRUE(client.ok()) << client.status();
}

// The request timeout (AuthStoreServerOptions::request_timeout, 30 s by default, 1 s here) bounds
// a request once it has started, never the idle time before it: a connection that stops halfway
// through a request is dropped after it, and so is one that never authenticates (after the
// handshake timeout); an authenticated connection idle for 3 timeouts, whose next request then
// arrives in pieces, is served (it was dropped: the deadline was taken before the idle wait); and
// a busy one (a get waiting longer than the timeout, then request after request) is kept.
TEST(AuthStore, TheRequestTimeoutDropsStalledAndUnauthenticatedConnectionsNotIdleOrBusyOnes) {
  // Long enough that a loaded machine's scheduling (the test's 100 ms gap, its clock reads) stays
  // well inside it.
  const milliseconds timeout(1000);
  auto host = Host({.handshake_timeout = timeout, .request_timeout = timeout});
  const int port = host->getPort();
  wire::Frame num_keys;
  num_keys.code = wire::kNumKeys;
  const std::string request = wire::EncodeFrame(num_keys);
  const auto answered = [](int fd) {
    absl::StatusOr<wire::Frame> answer = wire::ReadFrame(fd, 1 << 20, Clock::now() + seconds(5), seconds(5));
    return answer.ok() && answer->code == wire::kOk;
  };

  // Unauthenticated and silent: dropped after the handshake timeout.
  const auto start = Clock::now();
  const int stranger = RawConnect(port);
  ASSERT_GE(stranger, 0);
  EXPECT_EQ(ReadUntilClosed(stranger).size(), wire::kServerHelloBytes);  // the greeting, then closed
  // Less a little: the server's poll waits in whole milliseconds, rounded down (seen 0.55 ms early).
  EXPECT_GE(Clock::now() - start, timeout - milliseconds(20));
  EXPECT_LT(Clock::now() - start, seconds(10));
  close(stranger);

  // Authenticated, then three bytes of a request and nothing more: dropped after the timeout.
  const int stalled = RawAuthenticated(port);
  ASSERT_GE(stalled, 0);
  const auto stalled_at = Clock::now();  // before the write: the server's clock starts after it
  ASSERT_TRUE(wire::WriteAll(stalled, request.substr(0, 3), Clock::now() + seconds(5)).ok());
  EXPECT_EQ(ReadUntilClosed(stalled), "");
  EXPECT_GE(Clock::now() - stalled_at, timeout - milliseconds(20));
  EXPECT_LT(Clock::now() - stalled_at, seconds(10));
  EXPECT_EQ(host->server().stats().clients, 0);  // its end, not ours: the socket is still open here
  close(stalled);

  // Authenticated and idle for three timeouts (the idle time is what is tested), then a request
  // in two pieces 100 ms apart: served, and the connection goes on.
  const int idle = RawAuthenticated(port);
  ASSERT_GE(idle, 0);
  std::this_thread::sleep_for(3 * timeout);
  ASSERT_TRUE(wire::WriteAll(idle, request.substr(0, 2), Clock::now() + seconds(5)).ok());
  std::this_thread::sleep_for(milliseconds(100));
  ASSERT_TRUE(wire::WriteAll(idle, request.substr(2), Clock::now() + seconds(5)).ok());
  EXPECT_TRUE(answered(idle)) << "an idle connection's late request was not served";
  ASSERT_TRUE(wire::WriteAll(idle, request, Clock::now() + seconds(5)).ok());
  EXPECT_TRUE(answered(idle));
  close(idle);

  // Busy: a get that waits 3 timeouts for its key, then requests back to back for 3 timeouts.
  auto client = Join(port);
  ASSERT_TRUE(client.ok()) << client.status();
  std::thread setter([&] {
    std::this_thread::sleep_for(3 * timeout);  // the wait being longer than the timeout is the point
    host->set("late", Bytes("v"));
  });
  EXPECT_EQ((*client)->get("late"), Bytes("v"));
  setter.join();
  for (const auto end = Clock::now() + 3 * timeout; Clock::now() < end;) {
    EXPECT_TRUE(Thrown([&] { (*client)->add("count", 1); }).ok());
  }
  EXPECT_TRUE(Thrown([&] { (*client)->getNumKeys(); }).ok());
  EXPECT_TRUE(Eventually([&] { return host->server().stats().clients == 1; })) << host->server().stats().clients;
}

// Strangers that open connections and say nothing cannot keep a rank out: each new connection
// drops the oldest handshake when all slots are taken.
TEST(AuthStore, SilentConnectionsCannotKeepARankOut) {
  auto host = Host({.handshake_timeout = seconds(60), .max_pending = 4});
  std::vector<int> silent;
  for (int i = 0; i < 8; ++i) silent.push_back(RawConnect(host->getPort()));
  const auto start = Clock::now();
  auto client = Join(host->getPort());
  EXPECT_TRUE(client.ok()) << client.status();
  EXPECT_LT(Clock::now() - start, seconds(10));
  // The dropped ones' threads end promptly: no more handshakes are held than the cap.
  EXPECT_TRUE(Eventually([&] { return host->server().stats().pending <= 4; })) << host->server().stats().pending;
  for (int fd : silent) close(fd);
}

TEST(AuthStore, ListensOnItsOneAddressOnly) {
  auto host = Host({.host = "127.0.0.1"});
  EXPECT_EQ(host->server().address(), "127.0.0.1");
  const int here = RawConnect(host->getPort(), "127.0.0.1");
  EXPECT_GE(here, 0);
  close(here);
  // 127.0.0.2 is this host too (all of 127/8 is loopback), but not the address served.
  EXPECT_EQ(RawConnect(host->getPort(), "127.0.0.2"), -1);
}

TEST(AuthStore, WaitsEndAtTheServersBoundAndWhenItCloses) {
  auto host = Host({.max_wait = milliseconds(300)});
  auto client = Join(host->getPort(), kSecret, seconds(60));
  ASSERT_TRUE(client.ok()) << client.status();
  auto start = Clock::now();
  absl::Status s = Thrown([&] { (*client)->wait({"never"}); });  // the client asks for 60 s
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(Clock::now() - start, seconds(10));
  host->setTimeout(seconds(60));  // the job's timeout: now the bound
  std::thread closer([&] {
    std::this_thread::sleep_for(milliseconds(200));
    host.reset();  // the server goes with the last reference
  });
  start = Clock::now();
  s = Thrown([&] { (void)(*client)->get("never"); });
  closer.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_LT(Clock::now() - start, seconds(10));
  s = Thrown([&] { (*client)->set("k", Bytes("v")); });  // broken for good
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

// A port answered by something that does not know the secret (another process took it) is not
// trusted with the rank's keys.
TEST(AuthStore, AServerWithoutTheSecretIsRefusedByTheClient) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  socklen_t length = sizeof(a);
  getsockname(listener, reinterpret_cast<sockaddr*>(&a), &length);
  std::thread impostor([&] {
    const int fd = accept(listener, nullptr, nullptr);
    const auto deadline = Clock::now() + seconds(5);
    (void)wire::WriteAll(fd, std::string(wire::kServerMagic) + std::string(wire::kNonceBytes, 's'), deadline);
    (void)wire::ReadExactly(fd, wire::kClientHelloBytes, deadline);
    (void)wire::WriteAll(fd, std::string(1, wire::kAccepted) + std::string(wire::kMacBytes, 'm'), deadline);
    ReadUntilClosed(fd);
    close(fd);
  });
  auto client = Join(ntohs(a.sin_port));
  impostor.join();
  close(listener);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kPermissionDenied) << client.status();
  EXPECT_TRUE(absl::StrContains(client.status().message(), "did not prove")) << client.status();
}

TEST(AuthStore, NothingListeningIsUnavailableAfterTheTimeout) {
  int port = 0;
  {
    auto probe = Host();
    port = probe->getPort();
  }
  const auto start = Clock::now();
  auto client = Join(port, kSecret, milliseconds(500));
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable) << client.status();
  EXPECT_GE(Clock::now() - start, milliseconds(450));
  EXPECT_LT(Clock::now() - start, seconds(10));
}

}  // namespace
}  // namespace bertshard::worker
