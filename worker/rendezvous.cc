#include "worker/rendezvous.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace bertshard::worker {

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const RendezvousOptions& o) {
  if (o.store) {
    // Made before the job's timeout was known (ReservePort): every wait through it must give up
    // after this job's timeout, as on a store made here.
    o.store->setTimeout(o.timeout);
    return o.store;
  }
  if (o.rank == 0) {
    absl::StatusOr<c10::intrusive_ptr<HostedStore>> hosted =
        HostedStore::Start({.host = o.master_addr, .port = o.master_port, .secret = o.secret, .max_wait = o.timeout});
    if (!hosted.ok()) {
      return absl::Status(hosted.status().code(), absl::StrCat("rendezvous at ", o.master_addr, ":", o.master_port,
                                                               ": ", hosted.status().message()));
    }
    return c10::intrusive_ptr<c10d::Store>(*std::move(hosted));
  }
  absl::StatusOr<c10::intrusive_ptr<AuthStoreClient>> client = AuthStoreClient::Connect(
      {.host = o.master_addr, .port = o.master_port, .secret = o.secret, .timeout = o.timeout});
  if (!client.ok()) return client.status();  // its message names the address
  return c10::intrusive_ptr<c10d::Store>(*std::move(client));
}

absl::StatusOr<c10::intrusive_ptr<HostedStore>> HostStore(const std::string& host, const std::string& secret,
                                                          std::chrono::milliseconds timeout) {
  // Port 0: an ephemeral port, bound at once; getPort() reports it.
  absl::StatusOr<c10::intrusive_ptr<HostedStore>> hosted =
      HostedStore::Start({.host = host, .port = 0, .secret = secret, .max_wait = timeout});
  if (!hosted.ok()) {
    return absl::Status(hosted.status().code(),
                        absl::StrCat("cannot host a rendezvous store: ", hosted.status().message()));
  }
  return hosted;
}

absl::Status StoreBarrier(c10d::Store& store, const std::string& key, int world_size) {
  try {
    // The last to arrive opens the gate; wait() gives up after the store's timeout.
    if (store.add(key + "/arrived", 1) == world_size) store.set(key + "/open", std::vector<uint8_t>{1});
    store.wait({key + "/open"});
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("barrier ", key, " failed: ", e.what()));
  }
}

ReservedStores::ReservedStores(absl::Duration ttl, std::string host)
    : ttl_(ttl), host_(std::move(host)), expirer_([this] { ExpireLoop(); }) {}

ReservedStores::~ReservedStores() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.Signal();
  }
  expirer_.join();
}

absl::StatusOr<int> ReservedStores::Reserve(const std::string& job_id, const std::string& secret) {
  // The claimer sets the job's timeout (ConnectStore), which then bounds the peers' waits too.
  auto store = HostStore(host_, secret, c10d::Store::kDefaultTimeout);
  if (!store.ok()) return store.status();
  const int port = (*store)->getPort();
  absl::MutexLock lock(&mu_);
  // The port is bound: no other reservation here can hold it.
  reserved_[port] = Reservation{*std::move(store), absl::Now() + ttl_, job_id, secret};
  changed_.Signal();
  return port;
}

c10::intrusive_ptr<c10d::Store> ReservedStores::Claim(const std::string& job_id, int port, const std::string& secret) {
  absl::MutexLock lock(&mu_);
  auto it = reserved_.find(port);
  // Another job's store is not taken: that job's rank 0 will come for it. Nor one made for another
  // load attempt of this job (another secret): its ranks could not join it.
  if (it == reserved_.end() || (!it->second.job_id.empty() && it->second.job_id != job_id) ||
      !wire::SameSecretBytes(it->second.secret, secret)) {
    return {};
  }
  c10::intrusive_ptr<c10d::Store> store = std::move(it->second.store);
  reserved_.erase(it);
  return store;
}

void ReservedStores::ExpireLoop() {
  std::vector<c10::intrusive_ptr<c10d::Store>> expired;
  mu_.Lock();
  while (!stopping_) {
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [port, reservation] : reserved_) next = std::min(next, reservation.expires);
    changed_.WaitWithDeadline(&mu_, next);
    const absl::Time now = absl::Now();
    for (auto it = reserved_.begin(); it != reserved_.end();) {
      if (it->second.expires > now) {
        ++it;
        continue;
      }
      expired.push_back(std::move(it->second.store));
      it = reserved_.erase(it);
    }
    if (expired.empty()) continue;
    // Closed without the lock: closing a store joins its server's threads.
    mu_.Unlock();
    expired.clear();
    mu_.Lock();
  }
  mu_.Unlock();
}

}  // namespace bertshard::worker
