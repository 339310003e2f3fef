// File: model/torch_status.h
// -----------------------------------------------------------------------------
// LibTorch reports failures by throwing; bertshard's library code returns statuses. This is the
// one place an escaped LibTorch exception becomes a status, so that each kind gets the code a
// caller can act on: out of memory (a CUDA allocation, or a CPU one where LibTorch says so) is
// RESOURCE_EXHAUSTED with what to change, anything else INTERNAL (inputs are validated before
// LibTorch sees them, so another escaped error is a bug). Messages carry LibTorch's text without
// its C++ backtrace.
//
// Thread safety: stateless functions.
#ifndef BERTSHARD_MODEL_TORCH_STATUS_H_
#define BERTSHARD_MODEL_TORCH_STATUS_H_

#include <exception>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace bertshard::model {

// `during`: what was running ("forward", "loading rank 3"), first in the message.
absl::Status StatusFromTorchError(const std::exception& error, absl::string_view during);

}  // namespace bertshard::model

#endif  // BERTSHARD_MODEL_TORCH_STATUS_H_
