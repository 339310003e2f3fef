// File: client/init_checkpoint.h
// -----------------------------------------------------------------------------
// `shardctl init-checkpoint`: writes a randomly initialised HuggingFace model directory
// (config.json + model.safetensors, float32) for a variant and config, the way HF's
// `_init_weights` initialises BERT: linear and embedding weights ~ N(0, initializer_range 0.02),
// biases 0, LayerNorm weight 1 and bias 0, the padding token's embedding row 0. Tied decoder
// weights are stored once, as HF stores them. There is no model hub here: tests, the demo and
// benchmarks make their own checkpoints.
//
// Thread safety: thread-safe (no shared state).
#ifndef BERTSHARD_CLIENT_INIT_CHECKPOINT_H_
#define BERTSHARD_CLIENT_INIT_CHECKPOINT_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bertshard/v1/plan.pb.h"
#include "client/command_line.h"

namespace bertshard::client {

// Writes `directory` (created if missing). INVALID_ARGUMENT for an invalid variant/config (the
// planner's checks), INTERNAL for I/O errors.
absl::Status InitCheckpoint(v1::ModelVariant variant, const v1::BertConfig& config, uint64_t seed,
                            const std::string& directory);

// --variant and --config (as for plan), --seed, --out, --vocab.
const std::vector<Flag>& InitCheckpointFlags();
int RunInitCheckpointCommand(const CommandLine& command_line, std::FILE* out, std::FILE* err);

}  // namespace bertshard::client

#endif  // BERTSHARD_CLIENT_INIT_CHECKPOINT_H_
