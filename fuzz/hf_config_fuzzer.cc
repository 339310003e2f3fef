// Fuzz target: a checkpoint's config.json text -> planner::ParseHfConfigJson, and when it parses, a
// plan of the resulting model (sizes from the file are the planner's input too).
#include <cstdint>
#include <string>

#include "planner/model_config.h"
#include "planner/planner.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto hf = bertshard::planner::ParseHfConfigJson(text);
  if (!hf.ok()) return 0;
  bertshard::v1::PlanRequest request;
  *request.mutable_config() = hf->config;
  request.set_variant(hf->variant);
  request.mutable_parallel()->set_tp_size(2);
  request.mutable_parallel()->set_pp_size(2);
  (void)bertshard::planner::Plan(request);
  return 0;
}
