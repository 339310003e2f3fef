#include "common/fault_point.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

namespace bertshard::common {
namespace {

const std::string& FaultDir() {
  static const std::string* dir = [] {
    const char* d = std::getenv("BERTSHARD_FAULT_DIR");
    return new std::string(d == nullptr ? "" : d);
  }();
  return *dir;
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

}  // namespace

void PausePoint(std::string_view name) {
  const std::string& dir = FaultDir();
  if (dir.empty()) return;
  const std::string hold = dir + "/" + std::string(name) + ".hold";
  if (!Exists(hold)) return;
  // Written whole under a temporary name and renamed, so a test never sees a half-made marker.
  const std::string reached = dir + "/" + std::string(name) + "." + std::to_string(getpid()) + ".reached";
  std::ofstream(reached + ".tmp").close();
  std::rename((reached + ".tmp").c_str(), reached.c_str());
  while (Exists(hold)) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

}  // namespace bertshard::common
