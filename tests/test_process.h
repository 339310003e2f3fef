// File: tests/test_process.h
// -----------------------------------------------------------------------------
// Helpers for end-to-end tests that run the built binaries as a user would: spawn + exec with
// output to files, wait, read, and find the port a server printed ("listening on port N").
//
// Thread safety: thread-compatible.
#ifndef BERTSHARD_TESTS_TEST_PROCESS_H_
#define BERTSHARD_TESTS_TEST_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace bertshard::testing {

inline std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Starts `args` (args[0] is the binary) with stdout appended to `out` and stderr to `err` (the
// same file when `err` is empty), and standard input read from `in` when given (else the test's
// own); returns the pid, or -1.
inline pid_t Spawn(const std::vector<std::string>& args, const std::string& out, const std::string& err = "",
                   const std::string& in = "") {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!in.empty()) posix_spawn_file_actions_addopen(&actions, 0, in.c_str(), O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (err.empty()) {
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
  } else {
    posix_spawn_file_actions_addopen(&actions, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

inline int WaitExit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

struct Captured {
  int exit_code = -1;
  std::string out, err;
};

// Runs `args` to completion and returns its exit status, stdout and stderr. `input`, when given,
// is its standard input.
inline Captured Run(const std::vector<std::string>& args, const std::optional<std::string>& input = std::nullopt) {
  static int counter = 0;
  const std::string base = TempDir() + "/run_" + std::to_string(getpid()) + "_" + std::to_string(counter++);
  std::ofstream(base + ".out", std::ios::trunc).close();
  if (input.has_value()) std::ofstream(base + ".in", std::ios::binary) << *input;
  Captured c;
  c.exit_code = WaitExit(Spawn(args, base + ".out", base + ".err", input.has_value() ? base + ".in" : ""));
  c.out = ReadAll(base + ".out");
  c.err = ReadAll(base + ".err");
  return c;
}

// The port from the first "listening on port N" line of `log`, waiting up to ~10 s; 0 if none.
inline int WaitForPort(const std::string& log) {
  for (int i = 0; i < 200; ++i) {
    const std::string out = ReadAll(log);
    const size_t at = out.find("listening on port ");
    if (at != std::string::npos && out.find('\n', at) != std::string::npos) return std::atoi(out.c_str() + at + 18);
    usleep(50 * 1000);
  }
  return 0;
}

}  // namespace bertshard::testing

#endif  // BERTSHARD_TESTS_TEST_PROCESS_H_
