// File: server/job_names.h
// -----------------------------------------------------------------------------
// What a job's name may be (SubmitJobRequest.name). A name is how HTTP clients pick a job (TEI's
// and OpenAI's `model` field, docs/http.md) and how people remember one (`shardctl submit --name
// minilm`), so it has to read the same in a URL, a JSON string and a shell: 1..kMaxJobNameLength
// of ASCII letters, digits and `._-/:` (as HF model ids are: "sentence-transformers/all-MiniLM-L6-v2"),
// starting with a letter or digit, and never `job-...`, which is what ids look like (a name must
// never be mistaken for another job's id).
//
// Example:
//   CheckJobName("minilm");         // OK
//   CheckJobName("job-1");          // INVALID_ARGUMENT: reads as an id
//
// Thread safety: thread-safe (a pure function).
#ifndef BERTSHARD_SERVER_JOB_NAMES_H_
#define BERTSHARD_SERVER_JOB_NAMES_H_

#include <string>

#include "absl/status/status.h"

namespace bertshard::server {

inline constexpr int kMaxJobNameLength = 128;

// OK for a valid name; INVALID_ARGUMENT saying what a name may be otherwise (the empty name too:
// callers treat "" as "no name" before asking).
absl::Status CheckJobName(const std::string& name);

}  // namespace bertshard::server

#endif  // BERTSHARD_SERVER_JOB_NAMES_H_
