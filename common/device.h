// File: common/device.h
// -----------------------------------------------------------------------------
// How bertshard names a worker's device: "cpu", or "cuda:N" for GPU N of its host. One parser
// for the worker's --device flag (worker/gpu_placement.h) and the coordinator's check of what
// workers report (server/placement.h), so that both read the same strings the same way; each
// says its own error, in its own terms.
//
// Thread safety: stateless functions.
#ifndef BERTSHARD_COMMON_DEVICE_H_
#define BERTSHARD_COMMON_DEVICE_H_

#include <optional>

#include "absl/strings/string_view.h"

namespace bertshard::common {

// N for "cuda:N" written the one way (N >= 0, no sign or leading zeros); nullopt for anything
// else, "cpu" included.
std::optional<int> CudaIndex(absl::string_view device);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_DEVICE_H_
