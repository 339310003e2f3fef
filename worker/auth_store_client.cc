// AuthStoreClient (worker/auth_store.h): connecting, proving, and one request at a time.
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/secure_random.h"
#include "worker/auth_store.h"

namespace bertshard::worker {
namespace {

using wire::Clock;

// How one connection attempt ended: connected, worth another try (nothing listens yet, the
// server dropped us to make room), or final (the secret was refused, the peer is no rendezvous).
struct Attempt {
  int fd = -1;
  bool retry = false;
  absl::Status error;
};

Attempt Fail(int fd, bool retry, absl::Status error) {
  if (fd >= 0) close(fd);
  return {-1, retry, std::move(error)};
}

// A TCP connection to `address` by `deadline`.
Attempt ConnectSocket(const addrinfo& address, Clock::time_point deadline) {
  const int fd = socket(address.ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Fail(fd, true, absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno))));
  if (connect(fd, address.ai_addr, address.ai_addrlen) != 0) {
    if (errno != EINPROGRESS) return Fail(fd, true, absl::UnavailableError(std::strerror(errno)));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, POLLOUT, 0};
    if (left <= 0 || poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 5000))) <= 0) {
      return Fail(fd, true, absl::UnavailableError("connect timed out"));
    }
    int error = 0;
    socklen_t length = sizeof(error);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) return Fail(fd, true, absl::UnavailableError(std::strerror(error)));
  }
  return {fd, false, absl::OkStatus()};
}

// The handshake of worker/auth_store_wire.h on a connected socket.
Attempt Handshake(int fd, const std::string& secret, Clock::time_point deadline) {
  absl::StatusOr<std::string> hello = wire::ReadExactly(fd, wire::kServerHelloBytes, deadline);
  if (!hello.ok()) return Fail(fd, true, hello.status());
  if (absl::string_view(*hello).substr(0, 8) != wire::kServerMagic) {
    return Fail(fd, false, absl::UnavailableError("what answers there is not a bertshard rendezvous store"));
  }
  const std::string server_nonce = hello->substr(8);
  absl::StatusOr<std::string> nonce = common::SecureRandomBytes(wire::kNonceBytes);
  if (!nonce.ok()) return Fail(fd, false, nonce.status());
  const std::string proof = wire::HandshakeMac(secret, "client", server_nonce, *nonce);
  if (absl::Status s = wire::WriteAll(fd, absl::StrCat(wire::kClientMagic, *nonce, proof), deadline); !s.ok()) {
    return Fail(fd, true, s);
  }
  absl::StatusOr<std::string> verdict = wire::ReadExactly(fd, 1, deadline);
  if (!verdict.ok()) return Fail(fd, true, verdict.status());
  if ((*verdict)[0] == wire::kRefused) {
    return Fail(fd, false, absl::PermissionDeniedError("the rendezvous refused this rank's proof of the job's secret"));
  }
  if ((*verdict)[0] != wire::kAccepted) return Fail(fd, true, absl::UnavailableError("the rendezvous is full"));
  absl::StatusOr<std::string> theirs = wire::ReadExactly(fd, wire::kMacBytes, deadline);
  if (!theirs.ok()) return Fail(fd, true, theirs.status());
  // The other side must know the secret too: a port taken over by something else must not hand
  // this rank made-up peers.
  if (!wire::SameSecretBytes(*theirs, wire::HandshakeMac(secret, "server", server_nonce, *nonce))) {
    return Fail(fd, false,
                absl::PermissionDeniedError("the rendezvous server did not prove it knows the job's secret"));
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return {fd, false, absl::OkStatus()};
}

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string String(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

}  // namespace

absl::StatusOr<c10::intrusive_ptr<AuthStoreClient>> AuthStoreClient::Connect(const AuthStoreClientOptions& o) {
  if (absl::Status s = CheckRendezvousSecret(o.secret); !s.ok()) return s;
  const std::string where = absl::StrCat(o.host, ":", o.port);
  if (o.port <= 0 || o.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous at ", where, ": the port is out of range"));
  }
  const Clock::time_point deadline = Clock::now() + o.timeout;
  auto backoff = std::chrono::milliseconds(20);
  absl::Status last = absl::UnavailableError("no attempt");
  do {
    absl::StatusOr<wire::AddressList> found = wire::ResolveTcp(o.host, o.port);
    if (!found.ok()) {
      last = found.status();
    } else {
      for (addrinfo* a = found->get(); a != nullptr; a = a->ai_next) {
        Attempt attempt = ConnectSocket(*a, deadline);
        // The handshake gets a few seconds at most: a server that accepts and then says nothing
        // (not ours, or overloaded) is tried again.
        if (attempt.fd >= 0)
          attempt = Handshake(attempt.fd, o.secret, std::min(deadline, Clock::now() + std::chrono::seconds(10)));
        if (attempt.fd >= 0) return c10::make_intrusive<AuthStoreClient>(attempt.fd, o);
        if (!attempt.retry) {
          return absl::Status(attempt.error.code(),
                              absl::StrCat("rendezvous at ", where, ": ", attempt.error.message()));
        }
        last = attempt.error;
      }
    }
    std::this_thread::sleep_for(
        std::min<Clock::duration>(backoff, std::max<Clock::duration>(deadline - Clock::now(), {})));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  } while (Clock::now() < deadline);
  return absl::UnavailableError(
      absl::StrCat("rendezvous at ", where, ": not reached within ", o.timeout.count(), " ms: ", last.message()));
}

AuthStoreClient::AuthStoreClient(int fd, AuthStoreClientOptions options)
    : c10d::Store(options.timeout), options_(std::move(options)), fd_(fd) {}

AuthStoreClient::~AuthStoreClient() {
  absl::MutexLock lock(&mu_);
  if (fd_ >= 0) close(fd_);
}

wire::Frame AuthStoreClient::Call(const wire::Frame& request, std::chrono::milliseconds wait) {
  absl::MutexLock lock(&mu_);
  if (!broken_.empty()) throw AuthStoreError(absl::UnavailableError(broken_));
  // The server answers at once except for get and wait, which it bounds by `wait` (and by the
  // job's timeout): a little more than that, and the server is taken to be gone.
  const Clock::time_point deadline =
      wait.count() <= 0 ? Clock::time_point::max()
                        : Clock::now() + std::max<std::chrono::milliseconds>(wait, timeout_) + std::chrono::seconds(10);
  absl::Status sent = wire::WriteFrame(fd_, request, deadline);
  absl::StatusOr<wire::Frame> answer =
      sent.ok() ? wire::ReadFrame(fd_, options_.limits.max_value_bytes + 65536, deadline, deadline) : sent;
  if (!answer.ok()) {
    broken_ = absl::StrCat("the rendezvous connection to ", options_.host, ":", options_.port,
                           " is lost: ", answer.status().message());
    close(fd_);
    fd_ = -1;
    throw AuthStoreError(absl::UnavailableError(broken_));
  }
  if (answer->code != wire::kOk) {
    throw AuthStoreError(absl::Status(wire::CodeFor(answer->code),
                                      answer->fields.empty() ? "rendezvous request failed" : answer->fields[0]));
  }
  return *std::move(answer);
}

void AuthStoreClient::CheckKeyOrThrow(const std::string& key) const {
  if (key.size() > options_.limits.max_key_bytes) {
    throw AuthStoreError(absl::ResourceExhaustedError(absl::StrCat(
        "rendezvous key of ", key.size(), " bytes exceeds the limit of ", options_.limits.max_key_bytes, " bytes")));
  }
}

namespace {
void CheckValueOrThrow(const std::vector<uint8_t>& value, const AuthStoreLimits& limits) {
  if (value.size() > limits.max_value_bytes) {
    throw AuthStoreError(absl::ResourceExhaustedError(absl::StrCat(
        "rendezvous value of ", value.size(), " bytes exceeds the limit of ", limits.max_value_bytes, " bytes")));
  }
}
}  // namespace

void AuthStoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  CheckKeyOrThrow(key);
  CheckValueOrThrow(value, options_.limits);
  Call({wire::kSet, 0, {key, String(value)}}, timeout_);
}

std::vector<uint8_t> AuthStoreClient::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                                 const std::vector<uint8_t>& desired) {
  CheckKeyOrThrow(key);
  CheckValueOrThrow(expected, options_.limits);
  CheckValueOrThrow(desired, options_.limits);
  wire::Frame answer = Call({wire::kCompareSet, 0, {key, String(expected), String(desired)}}, timeout_);
  if (answer.fields.size() != 1) throw AuthStoreError(absl::InternalError("malformed rendezvous answer"));
  return Bytes(answer.fields[0]);
}

std::vector<uint8_t> AuthStoreClient::get(const std::string& key) {
  CheckKeyOrThrow(key);
  wire::Frame answer = Call({wire::kGet, timeout_.count(), {key}}, timeout_);
  if (answer.fields.size() != 1) throw AuthStoreError(absl::InternalError("malformed rendezvous answer"));
  return Bytes(answer.fields[0]);
}

int64_t AuthStoreClient::add(const std::string& key, int64_t value) {
  CheckKeyOrThrow(key);
  return Call({wire::kAdd, value, {key}}, timeout_).number;
}

bool AuthStoreClient::deleteKey(const std::string& key) {
  CheckKeyOrThrow(key);
  return Call({wire::kDelete, 0, {key}}, timeout_).number != 0;
}

bool AuthStoreClient::check(const std::vector<std::string>& keys) {
  for (const std::string& key : keys) CheckKeyOrThrow(key);
  return Call({wire::kCheck, 0, keys}, timeout_).number != 0;
}

int64_t AuthStoreClient::getNumKeys() { return Call({wire::kNumKeys, 0, {}}, timeout_).number; }

void AuthStoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void AuthStoreClient::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  for (const std::string& key : keys) CheckKeyOrThrow(key);
  Call({wire::kWait, timeout.count(), keys}, timeout);
}

}  // namespace bertshard::worker
