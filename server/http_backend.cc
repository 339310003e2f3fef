#include "server/http_backend.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/model_config.h"
#include "server/job_recovery.h"
#include "serving/pooling.h"

namespace bertshard::server {
namespace {

const char* DtypeName(v1::Dtype dtype) {
  switch (dtype) {
    case v1::BF16:
      return "bfloat16";
    case v1::FP16:
      return "float16";
    case v1::FP32:
    case v1::DTYPE_UNSPECIFIED:
    default:
      return "float32";
  }
}

}  // namespace

http::ModelInfo ClusterHttpBackend::Describe(const Cluster::ServingJob& job) {
  http::ModelInfo info;
  info.job_id = job.id;
  info.name = job.name;
  info.variant = job.plan.variant();
  info.architecture = std::string(planner::HfClassName(job.plan.variant()));
  const v1::BertConfig& config = job.plan.config();
  info.hidden_size = config.hidden_size();
  info.max_input_length = config.max_position_embeddings();
  info.dtype = DtypeName(job.plan.dtype());
  if (job.plan.variant() == v1::BERT_MODEL && job.assets->embedding.ok()) {
    const serving::EmbeddingConfig& embedding = *job.assets->embedding;
    info.pooling = serving::PoolingName(embedding.pooling);
    // Embed cuts at sentence-transformers' max_seq_length (job_serving.cc), the position table bounds it.
    info.max_input_length = std::min(embedding.max_seq_length.value_or(info.max_input_length), info.max_input_length);
  }
  if (job.assets->labels.ok()) info.labels = job.assets->labels->names;
  return info;
}

absl::StatusOr<std::string> ClusterHttpBackend::ResolveJob(const std::string& model) {
  return cluster_->ResolveJob(model);
}

absl::StatusOr<http::ModelInfo> ClusterHttpBackend::Model(const std::string& job_id) {
  for (const Cluster::ServingJob& job : cluster_->ServingJobs()) {
    if (job.id == job_id) return Describe(job);
  }
  // Not serving: the job says why (its state, recovering), as Embed would.
  absl::StatusOr<v1::Job> stored = cluster_->GetJob(job_id);
  if (!stored.ok()) return stored.status();
  if (!stored->recovering().empty()) {
    return absl::UnavailableError(absl::StrCat("job ", job_id, " is recovering (", stored->recovering(), "); retry"));
  }
  // Ended: it never serves again (the protocols' 4xx). Still on its way (PENDING, PLANNED, LOADING,
  // or READY with no replica answering this instant): a retry's matter (503).
  if (!TerminalState(stored->state())) {
    return absl::UnavailableError(
        absl::StrCat("job ", job_id, " is ", v1::JobState_Name(stored->state()), " and does not serve yet; retry"));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("job ", job_id, " is ", v1::JobState_Name(stored->state()), ": ", stored->failure_cause()));
}

std::vector<http::ModelInfo> ClusterHttpBackend::ServingModels() {
  std::vector<http::ModelInfo> models;
  for (const Cluster::ServingJob& job : cluster_->ServingJobs()) {
    http::ModelInfo info = Describe(job);
    if (const absl::StatusOr<v1::Job> stored = cluster_->GetJob(job.id); stored.ok()) {
      info.created_unix_seconds = stored->created_unix_millis() / 1000;
    }
    models.push_back(std::move(info));
  }
  return models;
}

absl::StatusOr<v1::EmbedResponse> ClusterHttpBackend::Embed(const v1::EmbedRequest& request,
                                                            const http::CallContext& call) {
  return cluster_->Embed(request, call.deadline, call.cancelled, Caller{call.client, call.connection});
}

absl::StatusOr<v1::InferResponse> ClusterHttpBackend::Infer(const v1::InferRequest& request,
                                                            const http::CallContext& call) {
  return cluster_->Infer(request, call.deadline, call.cancelled, Caller{call.client, call.connection});
}

absl::StatusOr<std::vector<http::TokenInfo>> ClusterHttpBackend::Tokenize(const std::string& job_id,
                                                                          const std::string& text,
                                                                          bool add_special_tokens) {
  absl::StatusOr<std::vector<TokenPiece>> pieces = cluster_->Tokenize(job_id, text, add_special_tokens);
  if (!pieces.ok()) return pieces.status();
  std::vector<http::TokenInfo> tokens;
  tokens.reserve(pieces->size());
  for (TokenPiece& p : *pieces) tokens.push_back({p.id, std::move(p.text), p.special});
  return tokens;
}

absl::StatusOr<std::string> ClusterHttpBackend::Decode(const std::string& job_id, const std::vector<int64_t>& ids) {
  return cluster_->Decode(job_id, ids);
}

absl::StatusOr<std::string> ClusterHttpBackend::Prompt(const std::string& job_id, const std::string& prompt_name) {
  for (const Cluster::ServingJob& job : cluster_->ServingJobs()) {
    if (job.id != job_id) continue;
    // A checkpoint without a readable sentence-transformers configuration has no prompts.
    static const serving::EmbeddingConfig* const kNone = new serving::EmbeddingConfig();
    return serving::PromptFor(job.assets->embedding.ok() ? *job.assets->embedding : *kNone, prompt_name);
  }
  const absl::Status why = Model(job_id).status();  // not serving: why, as Model says it
  return why.ok() ? absl::UnavailableError(absl::StrCat("job ", job_id, " stopped serving; retry")) : why;
}

}  // namespace bertshard::server
