// Fuzz target: a whole .safetensors file -> SafetensorsFile::Open, then every tensor's full read
// and a slice of its first dimension and of its last. A hostile header (offsets past the end,
// overlapping or huge shapes, wrong dtypes) must be refused, never read out of bounds.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"

namespace {
// One file per process, rewritten per input (Open maps a path).
const std::string& Path() {
  static const std::string path = [] {
    char name[] = "/tmp/safetensors_fuzzer_XXXXXX";
    const int fd = mkstemp(name);
    if (fd >= 0) close(fd);
    return std::string(name);
  }();
  return path;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(Path().c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  auto file = bertshard::checkpoint::SafetensorsFile::Open(Path());
  if (!file.ok()) return 0;
  for (const auto& [name, t] : (*file)->tensors()) {
    if (!bertshard::checkpoint::IsFloating(t.dtype) || t.numel() > (int64_t{1} << 22)) continue;
    std::vector<float> out(static_cast<size_t>(t.numel()));
    (void)(*file)->ReadSlice(t, {}, out.data());
    if (t.shape.empty() || t.shape[0] < 1) continue;
    (void)(*file)->ReadSlice(t, {0, 0, (t.shape[0] + 1) / 2}, out.data());
    const int last = static_cast<int>(t.shape.size()) - 1;
    (void)(*file)->ReadSlice(t, {last, t.shape[static_cast<size_t>(last)] / 2, t.shape[static_cast<size_t>(last)]},
                             out.data());
  }
  return 0;
}
