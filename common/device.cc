#include "common/device.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace bertshard::common {

std::optional<int> CudaIndex(absl::string_view device) {
  int index = -1;
  if (!absl::StartsWith(device, "cuda:") || !absl::SimpleAtoi(device.substr(5), &index) || index < 0 ||
      absl::StrCat("cuda:", index) != device) {
    return std::nullopt;
  }
  return index;
}

}  // namespace bertshard::common
