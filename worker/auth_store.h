// File: worker/auth_store.h
// -----------------------------------------------------------------------------
// The job's rendezvous store, authenticated: a small key-value server (c10d::Store semantics: set,
// get that waits, add, compareSet, deleteKey, check, getNumKeys, wait) that listens on one address
// only and serves a client only once it has proved it knows the job's secret. It replaces c10d's
// TCPStore, which listens on every interface and serves anyone who connects: a stranger could read
// the ranks' Gloo addresses and the shared-memory segment's name and token, fill the worker's
// memory, and fail a job by writing its keys (issue 21).
//
// The secret (16 to 256 bytes, 32 random ones in practice) is made by the coordinator for each
// load attempt and handed to every rank over the authenticated gRPC channel (LoadShardRequest);
// `shardctl run --local` passes its ranks one through a 0600 file. Each side proves itself with
// HMAC-SHA256 over both sides' fresh nonces (worker/auth_store_wire.h), compared in constant time;
// a wrong proof is refused and the connection closed before anything is read. The traffic after
// the handshake is not encrypted (nor is Gloo's): on a path where packets can be rewritten it can
// be tampered with; the secret itself never travels.
//
// Example:
//   ASSIGN_OR_RETURN(auto store, HostedStore::Start({.host = "10.0.0.7", .secret = secret}));
//   // ... the other ranks: ConnectAuthStore({.host = "10.0.0.7", .port = store->getPort(), .secret = secret})
//
// Bounds (AuthStoreLimits, generous for Gloo full meshes and NCCL ids at world size 64 and more):
// key and value sizes, keys held and bytes held (RESOURCE_EXHAUSTED past them); connections not yet
// authenticated (the oldest is dropped for a new one, each gets `handshake_timeout`) and
// authenticated ones; and every wait, at most the server's `max_wait` (the job's timeout).
//
// Failure model: Start and Connect return absl::Status (UNAVAILABLE: cannot bind, unreachable in
// time; PERMISSION_DENIED: the secret was refused, or the server could not prove it knows it;
// INVALID_ARGUMENT: a secret too short). The c10d::Store methods throw AuthStoreError (a
// std::runtime_error with the absl code) as c10d callers expect: DEADLINE_EXCEEDED for a wait that
// timed out, RESOURCE_EXHAUSTED past a limit, UNAVAILABLE once the connection is lost (the store is
// then broken for good, as a TCPStore whose server went away).
//
// Thread safety: thread-safe. A client runs one request at a time (a wait holds the others back).
#ifndef BERTSHARD_WORKER_AUTH_STORE_H_
#define BERTSHARD_WORKER_AUTH_STORE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/auth_store_wire.h"

namespace bertshard::worker {

inline constexpr size_t kMinRendezvousSecretBytes = 16;
inline constexpr size_t kMaxRendezvousSecretBytes = 256;

// OK for a usable secret; INVALID_ARGUMENT (never quoting it) otherwise.
absl::Status CheckRendezvousSecret(const std::string& secret);

struct AuthStoreLimits {
  size_t max_key_bytes = 4096;
  size_t max_value_bytes = size_t{4} << 20;
  int64_t max_keys = 1 << 18;
  // Keys and values held, each entry counted with 64 bytes more for its bookkeeping.
  int64_t max_total_bytes = int64_t{256} << 20;
  size_t max_keys_per_call = 1024;  // check and wait
};

// What a c10d::Store method throws: the store's error with its absl code.
class AuthStoreError : public std::runtime_error {
 public:
  explicit AuthStoreError(const absl::Status& status)
      : std::runtime_error(std::string(status.message())), code_(status.code()) {}
  absl::StatusCode code() const { return code_; }

 private:
  absl::StatusCode code_;
};

struct AuthStoreServerOptions {
  std::string host = "127.0.0.1";  // the one address served (a name is resolved; its first address)
  int port = 0;                    // 0: one the system picks
  std::string secret;
  std::chrono::milliseconds max_wait{120000};  // the longest any get or wait may last
  std::chrono::milliseconds handshake_timeout{3000};
  // Once a request's first byte is in, the rest must arrive within this, and the answer must be
  // taken within it: a client that stops halfway holds its thread no longer. Between requests a
  // connection may stay idle for good (a rank between collectives; a lost connection breaks the
  // store for that rank).
  std::chrono::milliseconds request_timeout{30000};
  int max_pending = 64;   // connections still in the handshake; a new one drops the oldest
  int max_clients = 512;  // authenticated connections; one more is told kBusy and closed
  AuthStoreLimits limits;
};

// The server: accepts, checks each client's proof, then serves its requests on a thread of its
// own. The key table's operations are public for the in-process store (HostedStore).
class AuthStoreServer {
 public:
  // UNAVAILABLE if the address cannot be resolved or bound; INVALID_ARGUMENT for a bad secret.
  static absl::StatusOr<std::unique_ptr<AuthStoreServer>> Start(AuthStoreServerOptions options);
  ~AuthStoreServer();  // closes every connection and joins their threads
  AuthStoreServer(const AuthStoreServer&) = delete;
  AuthStoreServer& operator=(const AuthStoreServer&) = delete;

  int port() const { return port_; }
  const std::string& address() const { return address_; }  // the numeric address bound
  void set_max_wait(std::chrono::milliseconds max_wait);

  struct Stats {
    int pending = 0;            // connections in the handshake now
    int clients = 0;            // authenticated connections now
    int64_t refused = 0;        // handshakes failed (wrong proof, timed out, dropped, busy), ever
    int64_t authenticated = 0;  // handshakes passed, ever
    int64_t keys = 0;
    int64_t bytes = 0;  // as counted against max_total_bytes
  };
  Stats stats();

  // The table. `deadline` bounds Get and Wait (capped at now + max_wait); `cancelled`, polled while
  // they wait, ends the wait early (UNAVAILABLE).
  absl::Status Set(const std::string& key, std::string value);
  absl::StatusOr<std::string> Get(const std::string& key, std::chrono::milliseconds timeout,
                                  const std::function<bool()>& cancelled = nullptr);
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta);
  absl::StatusOr<std::string> CompareSet(const std::string& key, const std::string& expected, std::string desired);
  absl::StatusOr<bool> Delete(const std::string& key);
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys);
  int64_t NumKeys();
  absl::Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                    const std::function<bool()>& cancelled = nullptr);

 private:
  struct Connection;
  AuthStoreServer(AuthStoreServerOptions options, int listen_fd, int wake_fd, int port, std::string address);
  void AcceptLoop();
  void Serve(Connection* connection);
  // Handshake; true when the client proved itself and was admitted.
  bool Admit(Connection* connection);
  wire::Frame Handle(const wire::Frame& request, Connection* connection);
  absl::Status CheckKey(const std::string& key) const;
  // Stores `value` at `key` within the limits; mu_ held.
  absl::Status PutLocked(const std::string& key, std::string value) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AwaitKeys(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                         const std::function<bool()>& cancelled) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const AuthStoreServerOptions options_;
  const int listen_fd_;
  const int wake_fd_;  // an eventfd: the destructor wakes the accept loop through it
  const int port_;
  const std::string address_;

  absl::Mutex mu_;
  absl::CondVar changed_;  // a key was set, or stopping_
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::chrono::milliseconds max_wait_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  int clients_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t authenticated_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread acceptor_;  // last: started once the rest is built
};

// Rank 0's store: the server and, in-process, its table as a c10d::Store (no socket of its own).
// setTimeout also bounds the waits of the server's clients.
class HostedStore final : public c10d::Store {
 public:
  static absl::StatusOr<c10::intrusive_ptr<HostedStore>> Start(AuthStoreServerOptions options);

  int getPort() const { return server_->port(); }
  AuthStoreServer& server() { return *server_; }

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  void setTimeout(const std::chrono::milliseconds& timeout) override;

  explicit HostedStore(std::unique_ptr<AuthStoreServer> server, std::chrono::milliseconds timeout);

 private:
  std::unique_ptr<AuthStoreServer> server_;
};

struct AuthStoreClientOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string secret;
  // Connecting (retried until then: rank 0 may not be up yet) and every request's default wait.
  std::chrono::milliseconds timeout{120000};
  AuthStoreLimits limits;  // checked before a request is sent (the server checks again)
};

// A connection to an AuthStoreServer, as a c10d::Store.
class AuthStoreClient final : public c10d::Store {
 public:
  // Connects and authenticates (see the failure model above).
  static absl::StatusOr<c10::intrusive_ptr<AuthStoreClient>> Connect(const AuthStoreClientOptions& options);
  ~AuthStoreClient() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  AuthStoreClient(int fd, AuthStoreClientOptions options);

 private:
  // Sends one request and returns the answer; throws AuthStoreError for a failed request, and
  // breaks the store for good when the connection fails.
  wire::Frame Call(const wire::Frame& request, std::chrono::milliseconds wait);
  void CheckKeyOrThrow(const std::string& key) const;

  const AuthStoreClientOptions options_;
  absl::Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_);
  std::string broken_ ABSL_GUARDED_BY(mu_);  // why the connection is gone ("" while it works)
};

}  // namespace bertshard::worker

#endif  // BERTSHARD_WORKER_AUTH_STORE_H_
