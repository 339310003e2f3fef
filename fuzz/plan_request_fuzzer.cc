// Fuzz target: bytes -> PlanRequest (binary protobuf, else proto JSON) -> planner::Plan. Any
// request must be planned or refused with a Status; never a crash, a hang or an exception.
#include <cstdint>
#include <string>

#include "common/proto_json.h"
#include "google/protobuf/stubs/logging.h"
#include "planner/planner.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Protobuf logs every string field with invalid UTF-8 it parses: noise at millions of inputs.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
    return true;
  }();
  (void)quiet;
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  bertshard::v1::PlanRequest request;
  if (!request.ParseFromString(bytes) && !bertshard::common::JsonToProto(bytes, &request).ok()) return 0;
  request.clear_checkpoint();  // a path would read the filesystem: the config fuzzer covers config.json
  (void)bertshard::planner::Plan(request);
  return 0;
}
