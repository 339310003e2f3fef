#include "worker/rendezvous.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/str_cat.h"

namespace bertshard::worker {

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const GlooOptions& o) {
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

}  // namespace bertshard::worker
