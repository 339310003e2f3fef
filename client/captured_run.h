// File: client/captured_run.h
// -----------------------------------------------------------------------------
// For tests: runs a command with its output and errors written to temporary files, and gives back
// its exit status and what it wrote to each.
//
// Example:
//   CapturedRun r = CaptureRun([&](std::FILE* out, std::FILE* err) { return RunShardctl(args, out, err); });
//   EXPECT_EQ(r.exit_code, 0) << r.err;
//
// Failure model: a temporary file that cannot be made reads as empty output.
// Thread safety: thread-safe (each call has its own files).
#ifndef BERTSHARD_CLIENT_CAPTURED_RUN_H_
#define BERTSHARD_CLIENT_CAPTURED_RUN_H_

#include <cstdio>
#include <functional>
#include <string>

namespace bertshard::client {

struct CapturedRun {
  int exit_code = 0;
  std::string out, err;
};

inline std::string ReadAndClose(std::FILE* f) {
  std::string text;
  if (f == nullptr) return text;
  std::rewind(f);
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), f)) > 0;) text.append(buffer, n);
  std::fclose(f);
  return text;
}

inline CapturedRun CaptureRun(const std::function<int(std::FILE* out, std::FILE* err)>& run) {
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  CapturedRun r;
  r.exit_code = run(out != nullptr ? out : stdout, err != nullptr ? err : stderr);
  r.out = ReadAndClose(out);
  r.err = ReadAndClose(err);
  return r;
}

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_CAPTURED_RUN_H_
