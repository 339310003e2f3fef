// Planning latency: BERT-base and BERT-large, tp 4 x pp 4, interleaved (2 chunks) and ZBV, plus
// the JSON rendering that `shardctl plan --batch` adds per line. Run:
//   bazel run -c opt //bench:planner_benchmark
#include <string>

#include "benchmark/benchmark.h"
#include "google/protobuf/arena.h"
#include "planner/plan_format.h"
#include "planner/planner.h"

namespace bertshard {
namespace {

v1::PlanRequest Request(bool large, v1::PipelineStyle style) {
  v1::PlanRequest r;
  r.set_variant(v1::BERT_FOR_PRE_TRAINING);
  if (large) {
    r.mutable_config()->set_hidden_size(1024);
    r.mutable_config()->set_num_hidden_layers(24);
    r.mutable_config()->set_num_attention_heads(16);
    r.mutable_config()->set_intermediate_size(4096);
  }
  r.mutable_parallel()->set_tp_size(4);
  r.mutable_parallel()->set_pp_size(4);
  r.mutable_parallel()->set_pp_style(style);
  r.mutable_parallel()->set_num_model_chunks(2);
  return r;
}

void BM_Plan(benchmark::State& state) {
  const v1::PlanRequest request = Request(state.range(0) == 1, static_cast<v1::PipelineStyle>(state.range(1)));
  int64_t tensors = 0;
  for (auto _ : state) {
    auto plan = planner::Plan(request);
    if (!plan.ok()) {
      state.SkipWithError("plan failed");
      break;
    }
    tensors = 0;
    for (const auto& rank : plan->ranks()) tensors += rank.tensors_size();
    benchmark::DoNotOptimize(plan);
  }
  state.counters["tensor_rows"] = static_cast<double>(tensors);
  state.SetLabel(std::string(state.range(0) == 1 ? "bert-large" : "bert-base") +
                 (state.range(1) == v1::ZBV ? " zbv" : " interleaved"));
}

// On an arena, as shardctl --batch uses it; with `json`, also renders the batch line (the output
// buffer is reused, as --batch reuses it).
void PlanOnArena(benchmark::State& state, bool json) {
  const v1::PlanRequest request = Request(state.range(0) == 1, static_cast<v1::PipelineStyle>(state.range(1)));
  std::string text;
  for (auto _ : state) {
    google::protobuf::Arena arena;
    auto* plan = google::protobuf::Arena::CreateMessage<v1::ShardPlan>(&arena);
    if (!planner::PlanInto(request, plan).ok()) {
      state.SkipWithError("plan failed");
      break;
    }
    if (json) {
      text.clear();
      planner::AppendPlanJson(*plan, 0, &text);
    }
    benchmark::DoNotOptimize(plan);
    benchmark::DoNotOptimize(text);
  }
  if (json) state.counters["json_bytes"] = static_cast<double>(text.size());
}

void BM_PlanOnArena(benchmark::State& state) { PlanOnArena(state, false); }
void BM_PlanAndJson(benchmark::State& state) { PlanOnArena(state, true); }

// Args: {0: bert-base, 1: bert-large} x pipeline style.
BENCHMARK(BM_Plan)->ArgsProduct({{0, 1}, {v1::INTERLEAVED, v1::ZBV}})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PlanOnArena)->ArgsProduct({{0, 1}, {v1::INTERLEAVED, v1::ZBV}})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PlanAndJson)->ArgsProduct({{0, 1}, {v1::INTERLEAVED, v1::ZBV}})->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace bertshard

BENCHMARK_MAIN();
