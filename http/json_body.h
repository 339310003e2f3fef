// File: http/json_body.h
// -----------------------------------------------------------------------------
// The JSON pieces TEI's and OpenAI's routes share: a request body read into protobuf's JSON
// value tree (google.protobuf.Value: no exceptions, no second JSON library), the typed reads of
// its fields with errors that name the field, and the writers of float vectors (shortest
// round-trip decimal, as serde_json writes an f32) and of base64 (OpenAI's encoding_format).
//
// Example:
//   ASSIGN_OR_RETURN(google::protobuf::Struct body, ParseJsonObject(R"({"inputs": "hi", "normalize": false})"));
//   ASSIGN_OR_RETURN(bool normalize, BoolField(body, "normalize", true));  // false
//   std::string out;
//   AppendFloatArray({0.5f, 1.f / 3}, &out);  // [0.5,0.33333334]
//
// Failure model: malformed JSON, a body that is not an object and a field of the wrong type are
// INVALID_ARGUMENT naming the field and what it must be. Nothing here aborts or throws.
//
// Thread safety: thread-safe (pure functions).
#ifndef BERTSHARD_HTTP_JSON_BODY_H_
#define BERTSHARD_HTTP_JSON_BODY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/struct.pb.h"

namespace bertshard::http {

// The body as a JSON object. INVALID_ARGUMENT for malformed JSON or anything but an object.
absl::StatusOr<google::protobuf::Struct> ParseJsonObject(absl::string_view body);

// The field `name` of `object`, or null when it is absent or JSON null.
const google::protobuf::Value* Field(const google::protobuf::Struct& object, const std::string& name);

// Typed reads: `fallback` when absent or null, INVALID_ARGUMENT ("`name` must be ...") when of
// another type.
absl::StatusOr<bool> BoolField(const google::protobuf::Struct& object, const std::string& name, bool fallback);
absl::StatusOr<std::string> StringField(const google::protobuf::Struct& object, const std::string& name,
                                        const std::string& fallback);
// A JSON number that is a whole number in [min, max].
absl::StatusOr<std::optional<int64_t>> IntField(const google::protobuf::Struct& object, const std::string& name,
                                                int64_t min, int64_t max);
// A value as a whole number in [min, max]; `what` names it in the error.
absl::StatusOr<int64_t> WholeNumber(const google::protobuf::Value& value, const std::string& what, int64_t min,
                                    int64_t max);

// One input of an embedding request: a text, or the model's token ids as they are.
struct InputItem {
  bool is_ids = false;
  std::string text;
  std::vector<int64_t> ids;
};

// `field` as TEI's and OpenAI's inputs: a string, a list of token ids, or a list of strings and
// token-id lists. `batch` says whether it was a list of inputs (TEI answers a single input
// unnested only in its error paths; both answer lists). INVALID_ARGUMENT naming `name` for
// anything else (absent, a number, an id outside 0..2^31-1).
struct ParsedInputs {
  std::vector<InputItem> items;
  bool batch = false;
};
absl::StatusOr<ParsedInputs> ParseInputs(const google::protobuf::Struct& object, const std::string& name);

// Appends `[v0,v1,...]`, each float in its shortest form that reads back as the same float.
void AppendFloatArray(absl::Span<const float> values, std::string* out);
// Appends TEI's sparse vector: `[{"index":i0,"value":v0},...]`, the floats as AppendFloatArray's.
// `indices` and `values` are of one length.
void AppendSparseVector(absl::Span<const int32_t> indices, absl::Span<const float> values, std::string* out);
// Standard base64 (RFC 4648, padded) of `bytes`.
std::string Base64(absl::string_view bytes);

}  // namespace bertshard::http

#endif  // BERTSHARD_HTTP_JSON_BODY_H_
