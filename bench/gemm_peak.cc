// gemm_peak: the measured peak of each CPU GEMM path on this machine, as one JSON object on stdout.
//
//   bazel run -c opt //bench:gemm_peak -- --threads 2
//   bazel-bin/bench/gemm_peak --threads 1 --shapes 1024x768x3072,2048x1024x4096 --runs 5
//   bazel-bin/bench/gemm_peak --baseline_rss --threads 1   # peak RSS of an "empty" LibTorch process
//
// Paths (--paths, comma-separated; default fp32_mm,fp32_onednn,bf16_linear,bf16_onednn):
//   fp32_mm       at::mm(x, w.t()) in float32: LibTorch's BLAS (Debian: OpenBLAS);
//   fp32_onednn   OneDnnLinear(x, PackOneDnnWeight(w)) in float32: model/gemm.h's path as the model
//                 runs it, the weight made once (transposed for oneDNN's sgemm where LibTorch's
//                 libdnnl has it, else oneDNN's layout with x and the product converted per call);
//   bf16_linear   at::linear(x, w) in bfloat16 (LibTorch picks the kernel: oneDNN's bf16 GEMM where
//                 it can, else a reference loop);
//   bf16_onednn   model/gemm.h's path on bfloat16 operands;
//   fp16_linear, fp16_onednn   the same in float16 (CPU LibTorch 1.13 mostly refuses them: null).
// A product M x K x N is x [M, K] times w [N, K]^T: 2 M K N flop. Each path and shape: one warm-up,
// then up to --runs timed runs (at least one; no new run starts once --budget_seconds are spent);
// the best run counts. Before the large shapes a path is probed on a 256 x 256 x 256 product, and
// skipped where that rate would make one run of a shape take over 10 x --budget_seconds (a slow
// reference loop). A path that throws (or is skipped) is reported as null, with the reason.
// "peak_gflops" of a path is its best over the shapes.
//
// The CPU facts (model name, and whether /proc/cpuinfo's flags show amx_bf16, amx_tile, avx512_bf16,
// avx512f, avx2) and the LibTorch threads (at::set_num_threads(--threads)) are in the object too.
//
// --baseline_rss measures nothing else: at::ones({1}) and one tiny at::linear, then prints this
// process's peak RSS (VmHWM of /proc/self/status), the baseline an empty LibTorch process costs. Run
// it in a fresh process, as the suite does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "model/gemm.h"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct Shape {
  int64_t m = 0, k = 0, n = 0;
  std::string Name() const { return std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n); }
  double Flop() const { return 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n); }
};

struct Options {
  int threads = 1;
  bool baseline_rss = false;
  std::vector<Shape> shapes = {{1024, 768, 3072}, {2048, 1024, 4096}};
  std::vector<std::string> paths = {"fp32_mm", "fp32_onednn", "bf16_linear", "bf16_onednn"};
  int runs = 5;
  double budget_seconds = 3.0;
};

[[noreturn]] void Usage(const std::string& error) {
  std::fprintf(stderr,
               "gemm_peak: %s\nusage: gemm_peak [--threads N] [--shapes MxKxN,...] [--paths P,...] [--runs R] "
               "[--budget_seconds S] | --baseline_rss [--threads N]\n",
               error.c_str());
  std::exit(2);
}

std::vector<std::string> Split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, sep)) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

long ParseInt(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || value < 1) Usage(flag + " wants a positive integer, not '" + text + "'");
  return value;
}

Options ParseOptions(int argc, char** argv) {
  Options o;
  const std::set<std::string> known_paths = {"fp32_mm",     "fp32_onednn", "bf16_linear",
                                             "bf16_onednn", "fp16_linear", "fp16_onednn"};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    const bool has_eq = arg.find('=') != std::string::npos;
    if (has_eq) {
      value = arg.substr(arg.find('=') + 1);
      arg = arg.substr(0, arg.find('='));
    }
    if (arg == "--baseline_rss") {
      o.baseline_rss = true;
      continue;
    }
    if (!has_eq) {
      if (i + 1 >= argc) Usage(arg + " needs a value");
      value = argv[++i];
    }
    if (arg == "--threads") {
      o.threads = static_cast<int>(ParseInt(arg, value));
    } else if (arg == "--runs") {
      o.runs = static_cast<int>(ParseInt(arg, value));
    } else if (arg == "--budget_seconds") {
      o.budget_seconds = std::atof(value.c_str());
      if (!(o.budget_seconds > 0)) Usage("--budget_seconds wants a positive number");
    } else if (arg == "--shapes") {
      o.shapes.clear();
      for (const std::string& s : Split(value, ',')) {
        const std::vector<std::string> dims = Split(s, 'x');
        if (dims.size() != 3) Usage("--shapes wants MxKxN[,MxKxN...], not '" + s + "'");
        o.shapes.push_back(
            {ParseInt("--shapes", dims[0]), ParseInt("--shapes", dims[1]), ParseInt("--shapes", dims[2])});
      }
      if (o.shapes.empty()) Usage("--shapes is empty");
    } else if (arg == "--paths") {
      o.paths = Split(value, ',');
      for (const std::string& p : o.paths) {
        if (!known_paths.count(p)) Usage("unknown path '" + p + "'");
      }
    } else {
      Usage("unknown flag " + arg);
    }
  }
  return o;
}

// A field of /proc/self/status in bytes (its "kB" figures), or -1.
long long StatusBytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::atoll(line.c_str() + field.size() + 1) * 1024;
  }
  return -1;
}

json CpuFacts() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model, flags;
  while (std::getline(cpuinfo, line) && (model.empty() || flags.empty())) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "model name" && model.empty()) model = value;
    if (key == "flags" && flags.empty()) flags = value;
  }
  std::set<std::string> flag_set;
  for (const std::string& f : Split(flags, ' ')) flag_set.insert(f);
  json facts = {{"model_name", model}};
  for (const char* f : {"amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_fp16", "avx512f", "avx2", "fma"}) {
    facts[f] = flag_set.count(f) > 0;
  }
  return facts;
}

double SecondsOf(const std::function<void()>& call) {
  const auto start = Clock::now();
  call();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The call that does one product of `shape` on `path`, its operands made (and weights packed) here.
std::function<void()> MakeProduct(const std::string& path, const Shape& shape) {
  const at::ScalarType dtype = path.rfind("fp32", 0) == 0   ? at::kFloat
                               : path.rfind("bf16", 0) == 0 ? at::kBFloat16
                                                            : at::kHalf;
  // A trained layer's scale; the figures do not depend on the values, but denormals would.
  const at::Tensor x = at::randn({shape.m, shape.k}).to(dtype);
  const at::Tensor w = (at::randn({shape.n, shape.k}) / std::sqrt(static_cast<double>(shape.k))).to(dtype);
  const std::string kind = path.substr(path.find('_') + 1);
  if (kind == "mm") return [x, w] { at::mm(x, w.t()); };
  if (kind == "linear") return [x, w] { at::linear(x, w); };
  const at::Tensor packed = bertshard::model::PackOneDnnWeight(w);
  return [x, packed] { bertshard::model::OneDnnLinear(x, packed, at::Tensor()); };
}

json MeasurePath(const std::string& path, const Options& o) {
  json result = {{"peak_gflops", nullptr}, {"shapes", json::array()}};
  if (path.find("onednn") != std::string::npos && !at::hasMKLDNN()) {
    result["error"] = "this LibTorch has no MKL-DNN (oneDNN)";
    return result;
  }
  double peak = 0;
  try {
    const Shape probe{256, 256, 256};
    std::function<void()> call = MakeProduct(path, probe);
    call();  // warm-up: threads, oneDNN's primitive for the shape
    double probe_best = 1e30;
    for (int i = 0; i < 2; ++i) probe_best = std::min(probe_best, SecondsOf(call));
    const double probe_gflops = probe.Flop() / std::max(1e-9, probe_best) / 1e9;
    result["probe_gflops"] = probe_gflops;
    for (const Shape& shape : o.shapes) {
      json entry = {{"shape", shape.Name()}, {"gflop", shape.Flop() / 1e9}};
      const double estimate = shape.Flop() / (probe_gflops * 1e9);
      if (estimate > 10 * o.budget_seconds) {
        entry["gflops"] = nullptr;
        entry["skipped"] = "the 256^3 probe ran at " + std::to_string(probe_gflops) +
                           " GFLOP/s: one run would take about " + std::to_string(estimate) + " s";
        result["shapes"].push_back(entry);
        continue;
      }
      call = MakeProduct(path, shape);
      const double warm = SecondsOf(call);
      double best = 1e30, spent = 0;
      int runs = 0;
      while (runs < o.runs && (runs == 0 || spent < o.budget_seconds)) {
        const double s = SecondsOf(call);
        best = std::min(best, s);
        spent += s;
        ++runs;
      }
      const double gflops = shape.Flop() / std::max(1e-9, best) / 1e9;
      peak = std::max(peak, gflops);
      entry["gflops"] = gflops;
      entry["best_seconds"] = best;
      entry["warmup_seconds"] = warm;
      entry["runs"] = runs;
      result["shapes"].push_back(entry);
    }
  } catch (const std::exception& e) {
    std::string what = e.what();
    result["error"] = what.substr(0, what.find('\n'));
    peak = 0;
  }
  if (peak > 0) result["peak_gflops"] = peak;
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = ParseOptions(argc, argv);
  at::set_num_threads(o.threads);
  if (o.baseline_rss) {
    const at::Tensor one = at::ones({1});
    const at::Tensor y = at::linear(at::ones({2, 4}), at::ones({3, 4}), at::ones({3}));
    json out = {{"threads", at::get_num_threads()},
                {"baseline_rss_bytes", StatusBytes("VmHWM")},
                {"rss_bytes", StatusBytes("VmRSS")},
                {"what", "peak RSS (VmHWM) of a process that did at::ones({1}) and one 2x4 at::linear"},
                {"check", (one.sum() + y.sum()).item<double>()}};
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  json out = {{"threads", at::get_num_threads()},   {"mkldnn", at::hasMKLDNN()}, {"runs", o.runs},
              {"budget_seconds", o.budget_seconds}, {"cpu", CpuFacts()},         {"paths", json::object()}};
  for (const std::string& path : o.paths) {
    std::fprintf(stderr, "gemm_peak: %s, %d threads\n", path.c_str(), o.threads);
    out["paths"][path] = MeasurePath(path, o);
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
