// Fuzz target: bytes -> KServe v2 raw tensor contents (http/kserve.h DecodeRaw: gRPC's
// raw_input_contents and HTTP's binary extension, both from the network). The first byte picks the
// datatype, the next two the shape (a high bit makes a dimension negative); the rest is the raw
// contents. Decoding never crashes and never keeps more elements than the shape takes; what it
// accepts of INT64 and BYTES encodes back to the very bytes it was given.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "http/kserve.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  static const char* const kDatatypes[] = {"INT64", "INT32", "BYTES", "FP32", "UINT8"};
  bertshard::http::kserve::Tensor tensor;
  tensor.name = "input_ids";
  tensor.datatype = kDatatypes[data[0] % (sizeof(kDatatypes) / sizeof(kDatatypes[0]))];
  for (const uint8_t d : {data[1], data[2]}) tensor.shape.push_back((d & 0x80) != 0 ? -(d & 0x7f) : (d & 0x7f));
  const std::string raw(reinterpret_cast<const char*>(data + 3), size - 3);
  if (!bertshard::http::kserve::DecodeRaw(raw, &tensor).ok()) return 0;
  const int64_t elements = tensor.shape[0] * tensor.shape[1];
  const size_t kept = tensor.datatype == "BYTES" ? tensor.bytes.size() : tensor.ints.size();
  if (tensor.shape[0] < 0 || tensor.shape[1] < 0 || static_cast<int64_t>(kept) != elements) std::abort();
  if ((tensor.datatype == "INT64" || tensor.datatype == "BYTES") && bertshard::http::kserve::EncodeRaw(tensor) != raw) {
    std::abort();
  }
  return 0;
}
