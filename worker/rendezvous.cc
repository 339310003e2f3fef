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
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(o.master_port);
    store_options.isServer = o.rank == 0;
    store_options.numWorkers = static_cast<size_t>(o.world_size);
    store_options.waitWorkers = false;
    store_options.timeout = o.timeout;
    return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::TCPStore>(o.master_addr, store_options));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rendezvous at ", o.master_addr, ":", o.master_port, ": ", e.what()));
  }
}

absl::StatusOr<c10::intrusive_ptr<c10d::TCPStore>> HostStore(std::chrono::milliseconds timeout) {
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = 0;  // an ephemeral port, bound at once; getPort() reports it (LibTorch 1.13 and 2.x)
    store_options.isServer = true;
    store_options.waitWorkers = false;  // the world's size is not known yet
    store_options.timeout = timeout;
    // The server listens on every interface; the host is only where this object's own client
    // reaches it.
    return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot host a rendezvous store: ", e.what()));
  }
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

ReservedStores::ReservedStores(absl::Duration ttl) : ttl_(ttl), expirer_([this] { ExpireLoop(); }) {}

ReservedStores::~ReservedStores() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.Signal();
  }
  expirer_.join();
}

absl::StatusOr<int> ReservedStores::Reserve(const std::string& job_id) {
  // The claimer sets the job's timeout (ConnectStore); this one only bounds the store's connection
  // to itself.
  auto store = HostStore(c10d::Store::kDefaultTimeout);
  if (!store.ok()) return store.status();
  const int port = (*store)->getPort();
  absl::MutexLock lock(&mu_);
  // The port is bound: no other reservation here can hold it.
  reserved_[port] = Reservation{*std::move(store), absl::Now() + ttl_, job_id};
  changed_.Signal();
  return port;
}

c10::intrusive_ptr<c10d::Store> ReservedStores::Claim(const std::string& job_id, int port) {
  absl::MutexLock lock(&mu_);
  auto it = reserved_.find(port);
  // Another job's store is not taken: that job's rank 0 will come for it.
  if (it == reserved_.end() || (!it->second.job_id.empty() && it->second.job_id != job_id)) return {};
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
