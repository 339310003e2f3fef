// File: common/proto_json.h
// -----------------------------------------------------------------------------
// JSON <-> protobuf for the public API, in the canonical proto3 JSON mapping with proto field
// names (snake_case) preserved, as docs/plan-contract.md specifies.
//
// Writing differs from protobuf's JsonUtil in one deliberate way: 64-bit integers are written as
// JSON numbers, not strings, so that `"param_bytes": 123456` reads as the contract shows. Values
// beyond 2^53 would lose precision in JavaScript readers; the planner refuses sizes that large.
// By default every field is written, defaults included (0, false, "", []), so that readers need
// not know proto3's omission rule; unset message fields and unset proto3 `optional` scalars are
// still absent, since absence is what they mean. `emit_defaults = false` gives protobuf's compact
// form (defaults omitted).
// google.protobuf.Struct keys are written sorted, for stable output.
//
// Example:
//   bertshard::v1::PlanRequest r;
//   absl::Status s = JsonToProto(R"({"variant": "BERT_MODEL"})", &r);   // ok
//   std::string j = ProtoToJson(r, {.indent = 0});   // {"variant":"BERT_MODEL"}
//
// Thread safety: thread-safe (no shared state).
#ifndef BERTSHARD_COMMON_PROTO_JSON_H_
#define BERTSHARD_COMMON_PROTO_JSON_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace bertshard::common {

struct JsonWriteOptions {
  // Spaces per nesting level; 0 writes one line with no spaces.
  int indent = 2;
  // Write scalar and repeated fields even when they hold their default value.
  bool emit_defaults = true;
  // Optional fast path for hot message types: called for every message before the generic
  // reflection-based writer; returns true if it appended the message's JSON itself (which must be
  // exactly what the generic writer would produce with these options).
  std::function<bool(const google::protobuf::Message&, std::string*)> message_writer;
};

// Appends the JSON of `message` to `*out`.
void AppendProtoJson(const google::protobuf::Message& message, const JsonWriteOptions& options, std::string* out);

std::string ProtoToJson(const google::protobuf::Message& message, const JsonWriteOptions& options = {});

// Parses `json` into `*message` (cleared first). Unknown fields are an error. Returns
// INVALID_ARGUMENT naming what could not be parsed.
absl::Status JsonToProto(absl::string_view json, google::protobuf::Message* message);

// Appends `text` as a quoted JSON string; a byte that starts no well-formed UTF-8 sequence becomes
// U+FFFD, so the output is always valid JSON.
void AppendJsonString(absl::string_view text, std::string* out);

// Appends the shortest decimal form of `value` that reads back as the same double.
void AppendJsonDouble(double value, std::string* out);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_PROTO_JSON_H_
