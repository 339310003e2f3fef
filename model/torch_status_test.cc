#include "model/torch_status.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <stdexcept>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace bertshard::model {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// What LibTorch's allocators throw (CUDA's caching allocator: TORCH_CHECK_WITH(OutOfMemoryError, ...)).
absl::Status Caught(void (*thrower)()) {
  try {
    thrower();
  } catch (const std::exception& e) {
    return StatusFromTorchError(e, "forward");
  }
  return absl::OkStatus();
}

TEST(StatusFromTorchError, OutOfMemoryIsResourceExhaustedWithWhatToChange) {
  const absl::Status status =
      Caught([] { TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate 2.00 GiB"); });
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(status.message(), HasSubstr("forward: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"));
  EXPECT_THAT(status.message(), HasSubstr("fewer tokens per forward"));
}

// A real allocation no machine has room for, on every device this LibTorch can reach: the CPU
// always, and a GPU where a CUDA build finds one (tools/gpu_check.sh runs this test there).
TEST(StatusFromTorchError, AnImpossibleAllocationIsResourceExhausted) {
  std::vector<at::Device> devices = {at::Device(at::kCPU)};
  if (at::hasCUDA()) devices.emplace_back(at::kCUDA, 0);
  for (const at::Device& device : devices) {
    absl::Status status;
    try {
      at::empty({int64_t{1} << 50}, at::TensorOptions().dtype(at::kByte).device(device));  // 1 PiB
    } catch (const std::exception& e) {
      status = StatusFromTorchError(e, "forward");
    }
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << device << ": " << status;
  }
}

TEST(StatusFromTorchError, OtherTorchErrorsAreInternalWithoutBacktrace) {
  const absl::Status status = Caught([] { TORCH_CHECK(false, "shape mismatch"); });
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_THAT(status.message(), HasSubstr("forward: shape mismatch"));
  // The backtrace (frames, "Exception raised from") stays out of the status.
  EXPECT_THAT(status.message(), Not(HasSubstr("Exception raised from")));
}

TEST(StatusFromTorchError, AnyStdExceptionIsInternal) {
  const absl::Status status = Caught([] { throw std::runtime_error("bad thing"); });
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(status.message(), "forward: bad thing");
}

}  // namespace
}  // namespace bertshard::model
