#include "model/torch_status.h"

#include <c10/util/Exception.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace bertshard::model {

absl::Status StatusFromTorchError(const std::exception& error, absl::string_view during) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
  // c10::Error::what() appends a C++ backtrace in some builds; the caller wants the message.
  std::string message = torch_error != nullptr ? torch_error->what_without_backtrace() : error.what();
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
  // CUDA's allocator throws OutOfMemoryError; LibTorch 1.13's CPU allocator a plain c10::Error
  // (an enforce failure), known by its text.
  const bool out_of_memory = dynamic_cast<const c10::OutOfMemoryError*>(&error) != nullptr ||
                             absl::StrContains(message, "DefaultCPUAllocator: can't allocate memory") ||
                             absl::StrContains(message, "DefaultCPUAllocator: not enough memory");
  if (out_of_memory) {
    return absl::ResourceExhaustedError(absl::StrCat(
        during, ": out of memory: ", message,
        " (run fewer tokens per forward, or spread the model over more tensor- or pipeline-parallel ranks)"));
  }
  return absl::InternalError(absl::StrCat(during, ": ", message));
}

}  // namespace bertshard::model
