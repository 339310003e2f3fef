// AuthStoreServer and HostedStore (worker/auth_store.h): accepting, the handshake, the key table.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/secure_random.h"
#include "worker/auth_store.h"

namespace bertshard::worker {
namespace {

using wire::Clock;

constexpr int64_t kEntryOverheadBytes = 64;

int64_t EntryBytes(const std::string& key, const std::string& value) {
  return static_cast<int64_t>(key.size() + value.size()) + kEntryOverheadBytes;
}

// A key as an error message may quote it: at most 64 bytes of it.
std::string Shown(const std::string& key) {
  return key.size() <= 64 ? key : absl::StrCat(key.substr(0, 64), "... (", key.size(), " bytes)");
}

std::string ShownKeys(const std::vector<std::string>& keys) {
  std::vector<std::string> shown;
  for (size_t i = 0; i < keys.size() && i < 4; ++i) shown.push_back(Shown(keys[i]));
  if (keys.size() > 4) shown.push_back(absl::StrCat("and ", keys.size() - 4, " more"));
  return absl::StrCat("[", absl::StrJoin(shown, ", "), "]");
}

size_t MaxRequestBodyBytes(const AuthStoreLimits& l) {
  return 2 * l.max_value_bytes + l.max_keys_per_call * (l.max_key_bytes + 4) + 64;
}

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string String(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

void ThrowIfError(const absl::Status& s) {
  if (!s.ok()) throw AuthStoreError(s);
}
template <typename T>
T ValueOrThrow(absl::StatusOr<T> v) {
  ThrowIfError(v.status());
  return *std::move(v);
}

}  // namespace

absl::Status CheckRendezvousSecret(const std::string& secret) {
  if (secret.size() < kMinRendezvousSecretBytes || secret.size() > kMaxRendezvousSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the rendezvous secret must be ", kMinRendezvousSecretBytes, " to ",
                                                   kMaxRendezvousSecretBytes, " bytes; it is ", secret.size()));
  }
  return absl::OkStatus();
}

struct AuthStoreServer::Connection {
  int fd = -1;
  Clock::time_point accepted;
  bool authenticated = false;  // guarded by the server's mu_
  bool evicted = false;        // guarded by the server's mu_: shut down to make room
  std::atomic<bool> done{false};
  std::thread thread;
};

absl::StatusOr<std::unique_ptr<AuthStoreServer>> AuthStoreServer::Start(AuthStoreServerOptions options) {
  if (absl::Status s = CheckRendezvousSecret(options.secret); !s.ok()) return s;
  if (options.host.empty()) return absl::InvalidArgumentError("the rendezvous needs a host to listen on");
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous port ", options.port, " is out of range"));
  }
  const std::string where = absl::StrCat(options.host, ":", options.port);
  absl::StatusOr<wire::AddressList> found = wire::ResolveTcp(options.host, options.port);
  if (!found.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot host a rendezvous on ", where, ": ", found.status().message()));
  }
  const addrinfo& first = **found;
  // The first address only: the store is served on exactly one.
  const int fd = socket(first.ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  const int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = fd >= 0 && bind(fd, first.ai_addr, first.ai_addrlen) == 0 && listen(fd, 128) == 0;
  const int error = errno;
  if (!bound) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(absl::StrCat("cannot host a rendezvous on ", where, ": ", std::strerror(error)));
  }
  sockaddr_storage local{};
  socklen_t length = sizeof(local);
  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length);
  char host[NI_MAXHOST] = "", service[NI_MAXSERV] = "";
  getnameinfo(reinterpret_cast<sockaddr*>(&local), length, host, sizeof(host), service, sizeof(service),
              NI_NUMERICHOST | NI_NUMERICSERV);
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot host a rendezvous: eventfd: ", std::strerror(errno)));
  }
  return std::unique_ptr<AuthStoreServer>(
      new AuthStoreServer(std::move(options), fd, wake, std::atoi(service), std::string(host)));
}

AuthStoreServer::AuthStoreServer(AuthStoreServerOptions options, int listen_fd, int wake_fd, int port,
                                 std::string address)
    : options_(std::move(options)),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      port_(port),
      address_(std::move(address)),
      max_wait_(options_.max_wait),
      acceptor_([this] { AcceptLoop(); }) {}

AuthStoreServer::~AuthStoreServer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  acceptor_.join();
  std::list<std::unique_ptr<Connection>> connections;
  {
    absl::MutexLock lock(&mu_);
    // Wakes every connection's read or write; each then ends its thread.
    for (auto& c : connections_) shutdown(c->fd, SHUT_RDWR);
    connections.swap(connections_);
  }
  for (auto& c : connections) {
    c->thread.join();
    close(c->fd);
  }
  close(listen_fd_);
  close(wake_fd_);
}

void AuthStoreServer::set_max_wait(std::chrono::milliseconds max_wait) {
  absl::MutexLock lock(&mu_);
  max_wait_ = max_wait;
}

AuthStoreServer::Stats AuthStoreServer::stats() {
  absl::MutexLock lock(&mu_);
  return {pending_, clients_, refused_, authenticated_, static_cast<int64_t>(values_.size()), bytes_};
}

void AuthStoreServer::AcceptLoop() {
  bool accept_backoff = false;  // the last accept failed for want of resources
  while (true) {
    pollfd polled[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    // Woken by a connection or the destructor; every quarter second it also reaps ended threads.
    // After a failed accept only the destructor wakes it before the next reaping.
    poll(accept_backoff ? &polled[1] : polled, accept_backoff ? 1 : 2, 250);
    if (accept_backoff) polled[0].revents = POLLIN;
    accept_backoff = false;
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (!(*it)->done.load()) {
        ++it;
        continue;
      }
      (*it)->thread.join();  // it has let go of mu_: done is its last act
      close((*it)->fd);
      it = connections_.erase(it);
    }
    if (!(polled[0].revents & POLLIN)) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // Out of descriptors or memory, the connection stays queued and the socket readable: wait
      // for the next pass (which reaps ended connections) rather than spin on it.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) accept_backoff = true;
      continue;
    }
    if (pending_ >= options_.max_pending) {
      // Full of handshakes: the oldest goes, so that strangers holding connections open cannot
      // keep a rank out for longer than it takes them to open new ones.
      for (auto& c : connections_) {
        if (!c->authenticated && !c->evicted && !c->done.load()) {
          c->evicted = true;
          shutdown(c->fd, SHUT_RDWR);
          break;
        }
      }
    }
    ++pending_;
    auto connection = std::make_unique<Connection>();
    connection->fd = fd;
    connection->accepted = Clock::now();
    Connection* c = connection.get();
    connections_.push_back(std::move(connection));
    try {
      c->thread = std::thread([this, c] { Serve(c); });
    } catch (const std::system_error&) {
      // No thread to be had (a pids limit): this connection is refused, the server goes on.
      connections_.pop_back();
      --pending_;
      close(fd);
    }
  }
}

bool AuthStoreServer::Admit(Connection* c) {
  const Clock::time_point deadline = c->accepted + options_.handshake_timeout;
  absl::StatusOr<std::string> nonce = common::SecureRandomBytes(wire::kNonceBytes);
  absl::StatusOr<std::string> hello;
  bool proved = false;
  if (nonce.ok() && wire::WriteAll(c->fd, absl::StrCat(wire::kServerMagic, *nonce), deadline).ok()) {
    hello = wire::ReadExactly(c->fd, wire::kClientHelloBytes, deadline);
    if (hello.ok() && absl::string_view(*hello).substr(0, 8) == wire::kClientMagic) {
      const std::string client_nonce = hello->substr(8, wire::kNonceBytes);
      proved = wire::SameSecretBytes(hello->substr(8 + wire::kNonceBytes),
                                     wire::HandshakeMac(options_.secret, "client", *nonce, client_nonce));
      if (proved) *hello = client_nonce;
    }
  }
  wire::Verdict verdict = wire::kRefused;
  {
    absl::MutexLock lock(&mu_);
    --pending_;
    // Dropped to make room while it proved itself: its socket is shut, it will try again.
    if (c->evicted) proved = false;
    if (proved && clients_ < options_.max_clients) {
      verdict = wire::kAccepted;
      c->authenticated = true;
      ++clients_;
      ++authenticated_;
    } else {
      verdict = proved ? wire::kBusy : wire::kRefused;
      ++refused_;
    }
  }
  if (verdict != wire::kAccepted) {
    // Told why only once it spoke the protocol: a client with the wrong secret fails at once
    // instead of retrying until its timeout. Nothing about the secret is in the answer.
    if (hello.ok()) (void)wire::WriteAll(c->fd, std::string(1, static_cast<char>(verdict)), deadline);
    return false;
  }
  const std::string proof = wire::HandshakeMac(options_.secret, "server", *nonce, *hello);
  if (!wire::WriteAll(c->fd, absl::StrCat(std::string(1, static_cast<char>(wire::kAccepted)), proof), deadline).ok()) {
    absl::MutexLock lock(&mu_);
    --clients_;
    return false;
  }
  const int one = 1;
  setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return true;
}

void AuthStoreServer::Serve(Connection* c) {
  if (Admit(c)) {
    const size_t max_body = MaxRequestBodyBytes(options_.limits);
    while (true) {
      // Idle for as long as the client likes (a rank between collectives); the destructor's
      // shutdown() ends the wait.
      absl::StatusOr<wire::Frame> request =
          wire::ReadFrame(c->fd, max_body, Clock::time_point::max(), options_.request_timeout);
      // A frame over the bound is not read: the connection goes, and the bytes with it.
      if (!request.ok()) break;
      const wire::Frame answer = Handle(*request, c);
      if (!wire::WriteFrame(c->fd, answer, Clock::now() + options_.request_timeout).ok()) break;
    }
    absl::MutexLock lock(&mu_);
    --clients_;
  }
  shutdown(c->fd, SHUT_RDWR);
  c->done.store(true);  // last: the accept loop may join and free `c` from here on
}

wire::Frame AuthStoreServer::Handle(const wire::Frame& request, Connection* c) {
  const std::vector<std::string>& f = request.fields;
  // A client that speaks (or leaves) while its get or wait is pending is not waited for any longer.
  const std::function<bool()> cancelled = [fd = c->fd] {
    pollfd p{fd, POLLIN | POLLRDHUP, 0};
    return poll(&p, 1, 0) > 0;
  };
  auto arity = [&](size_t n) { return f.size() == n; };
  auto answer = [](const absl::Status& s, int64_t number = 0) {
    wire::Frame a;
    a.code = wire::ReplyFor(s.code());
    a.number = number;
    if (!s.ok()) a.fields.push_back(std::string(s.message()));
    return a;
  };
  const absl::Status bad = absl::InvalidArgumentError(
      absl::StrCat("malformed rendezvous request (op ", request.code, ", ", f.size(), " fields)"));
  switch (request.code) {
    case wire::kSet:
      if (!arity(2)) return answer(bad);
      return answer(Set(f[0], f[1]));
    case wire::kGet: {
      if (!arity(1)) return answer(bad);
      absl::StatusOr<std::string> v = Get(f[0], std::chrono::milliseconds(request.number), cancelled);
      if (!v.ok()) return answer(v.status());
      wire::Frame a;
      a.fields.push_back(*std::move(v));
      return a;
    }
    case wire::kAdd: {
      if (!arity(1)) return answer(bad);
      absl::StatusOr<int64_t> v = Add(f[0], request.number);
      return v.ok() ? answer(absl::OkStatus(), *v) : answer(v.status());
    }
    case wire::kCompareSet: {
      if (!arity(3)) return answer(bad);
      absl::StatusOr<std::string> v = CompareSet(f[0], f[1], f[2]);
      if (!v.ok()) return answer(v.status());
      wire::Frame a;
      a.fields.push_back(*std::move(v));
      return a;
    }
    case wire::kDelete: {
      if (!arity(1)) return answer(bad);
      absl::StatusOr<bool> v = Delete(f[0]);
      return v.ok() ? answer(absl::OkStatus(), *v ? 1 : 0) : answer(v.status());
    }
    case wire::kCheck: {
      absl::StatusOr<bool> v = Check(f);
      return v.ok() ? answer(absl::OkStatus(), *v ? 1 : 0) : answer(v.status());
    }
    case wire::kNumKeys:
      if (!arity(0)) return answer(bad);
      return answer(absl::OkStatus(), NumKeys());
    case wire::kWait:
      return answer(Wait(f, std::chrono::milliseconds(request.number), cancelled));
    default:
      return answer(bad);
  }
}

absl::Status AuthStoreServer::CheckKey(const std::string& key) const {
  if (key.size() > options_.limits.max_key_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rendezvous key ", Shown(key), " exceeds the limit of ", options_.limits.max_key_bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status AuthStoreServer::PutLocked(const std::string& key, std::string value) {
  const AuthStoreLimits& l = options_.limits;
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (value.size() > l.max_value_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("rendezvous value of ", value.size(), " bytes for ", Shown(key),
                                                     " exceeds the limit of ", l.max_value_bytes, " bytes"));
  }
  auto it = values_.find(key);
  if (it == values_.end() && static_cast<int64_t>(values_.size()) >= l.max_keys) {
    return absl::ResourceExhaustedError(absl::StrCat("the rendezvous holds its limit of ", l.max_keys, " keys"));
  }
  const int64_t after = bytes_ - (it == values_.end() ? 0 : EntryBytes(key, it->second)) + EntryBytes(key, value);
  if (after > l.max_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "setting ", Shown(key), " would take the rendezvous past its limit of ", l.max_total_bytes, " bytes"));
  }
  bytes_ = after;
  if (it == values_.end()) {
    values_.emplace(key, std::move(value));
  } else {
    it->second = std::move(value);
  }
  changed_.SignalAll();
  return absl::OkStatus();
}

absl::Status AuthStoreServer::AwaitKeys(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                                        const std::function<bool()>& cancelled) {
  if (keys.size() > options_.limits.max_keys_per_call) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a rendezvous wait on ", keys.size(), " keys (at most ", options_.limits.max_keys_per_call, ")"));
  }
  for (const std::string& key : keys) {
    if (absl::Status s = CheckKey(key); !s.ok()) return s;
  }
  // No timeout (0) or a longer one than the job's: the job's.
  const auto bound = timeout.count() <= 0 ? max_wait_ : std::min(timeout, max_wait_);
  const absl::Time deadline = absl::Now() + absl::FromChrono(bound);
  auto all_there = [&] {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return values_.count(k) > 0; });
  };
  while (!all_there()) {
    if (stopping_) return absl::UnavailableError("the rendezvous is shutting down");
    if (cancelled && cancelled()) return absl::UnavailableError("the client left its wait");
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("rendezvous wait for ", ShownKeys(keys), " timed out after ", bound.count(), " ms"));
    }
    // In slices: the client's leaving is looked for between them.
    changed_.WaitWithDeadline(&mu_, std::min(deadline, absl::Now() + absl::Milliseconds(100)));
  }
  return absl::OkStatus();
}

absl::Status AuthStoreServer::Set(const std::string& key, std::string value) {
  absl::MutexLock lock(&mu_);
  return PutLocked(key, std::move(value));
}

absl::StatusOr<std::string> AuthStoreServer::Get(const std::string& key, std::chrono::milliseconds timeout,
                                                 const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = AwaitKeys({key}, timeout, cancelled); !s.ok()) return s;
  return values_.at(key);
}

absl::StatusOr<int64_t> AuthStoreServer::Add(const std::string& key, int64_t delta) {
  absl::MutexLock lock(&mu_);
  int64_t value = 0;
  if (auto it = values_.find(key); it != values_.end() && !absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous key ", Shown(key), " does not hold a number"));
  }
  if (__builtin_add_overflow(value, delta, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous counter ", Shown(key), " would overflow"));
  }
  if (absl::Status s = PutLocked(key, std::to_string(value)); !s.ok()) return s;
  return value;
}

absl::StatusOr<std::string> AuthStoreServer::CompareSet(const std::string& key, const std::string& expected,
                                                        std::string desired) {
  absl::MutexLock lock(&mu_);
  // As TCPStore: an absent key is created only when `expected` is empty; the answer is the value now.
  auto it = values_.find(key);
  const bool swap = it == values_.end() ? expected.empty() : it->second == expected;
  if (!swap) return it == values_.end() ? expected : it->second;
  if (absl::Status s = PutLocked(key, desired); !s.ok()) return s;
  return desired;
}

absl::StatusOr<bool> AuthStoreServer::Delete(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  if (it == values_.end()) return false;
  bytes_ -= EntryBytes(key, it->second);
  values_.erase(it);
  return true;
}

absl::StatusOr<bool> AuthStoreServer::Check(const std::vector<std::string>& keys) {
  absl::MutexLock lock(&mu_);
  if (keys.size() > options_.limits.max_keys_per_call) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a rendezvous check of ", keys.size(), " keys (at most ", options_.limits.max_keys_per_call, ")"));
  }
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return values_.count(k) > 0; });
}

int64_t AuthStoreServer::NumKeys() {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(values_.size());
}

absl::Status AuthStoreServer::Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                                   const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  return AwaitKeys(keys, timeout, cancelled);
}

absl::StatusOr<c10::intrusive_ptr<HostedStore>> HostedStore::Start(AuthStoreServerOptions options) {
  const std::chrono::milliseconds timeout = options.max_wait;
  absl::StatusOr<std::unique_ptr<AuthStoreServer>> server = AuthStoreServer::Start(std::move(options));
  if (!server.ok()) return server.status();
  return c10::make_intrusive<HostedStore>(*std::move(server), timeout);
}

HostedStore::HostedStore(std::unique_ptr<AuthStoreServer> server, std::chrono::milliseconds timeout)
    : c10d::Store(timeout), server_(std::move(server)) {}

void HostedStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  ThrowIfError(server_->Set(key, String(value)));
}
std::vector<uint8_t> HostedStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  return Bytes(ValueOrThrow(server_->CompareSet(key, String(expected), String(desired))));
}
std::vector<uint8_t> HostedStore::get(const std::string& key) {
  return Bytes(ValueOrThrow(server_->Get(key, timeout_)));
}
int64_t HostedStore::add(const std::string& key, int64_t value) { return ValueOrThrow(server_->Add(key, value)); }
bool HostedStore::deleteKey(const std::string& key) { return ValueOrThrow(server_->Delete(key)); }
bool HostedStore::check(const std::vector<std::string>& keys) { return ValueOrThrow(server_->Check(keys)); }
int64_t HostedStore::getNumKeys() { return server_->NumKeys(); }
void HostedStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
void HostedStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  ThrowIfError(server_->Wait(keys, timeout));
}
void HostedStore::setTimeout(const std::chrono::milliseconds& timeout) {
  c10d::Store::setTimeout(timeout);
  // The job's timeout bounds its peers' waits too (0, "none", leaves the bound as it was).
  if (timeout.count() > 0) server_->set_max_wait(timeout);
}

}  // namespace bertshard::worker
