// File: serving/pooling.h
// -----------------------------------------------------------------------------
// Sentence embeddings from a BERT's last_hidden_state, as sentence-transformers computes them (and
// HuggingFace text-embeddings-inference serves them): a checkpoint's sentence-transformers files say
// how token vectors are pooled into one vector per row (mean, CLS, max, mean/sqrt(len)) and whether
// it is L2-normalised. Plain C++ on float buffers: the coordinator that uses it links neither
// LibTorch nor anything else heavy.
//
// Example:
//   ASSIGN_OR_RETURN(EmbeddingConfig config, ReadEmbeddingConfig(checkpoint_dir));
//   ASSIGN_OR_RETURN(auto vectors, Pool(hidden, rows, seq, dim, attention_mask, config.pooling,
//                                       config.normalize));
//   double similarity = Cosine(vectors[0], vectors[1]);
//
// Thread safety: thread-safe (no state).
#ifndef BERTSHARD_SERVING_POOLING_H_
#define BERTSHARD_SERVING_POOLING_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/checkpoint_dir.h"

namespace bertshard::serving {

// sentence-transformers' pooling modes that map onto one vector of the hidden size. (Weighted mean
// and last-token pooling are not here: see ReadEmbeddingConfig.)
enum class Pooling { kMean, kCls, kMax, kMeanSqrtLen };

// "mean", "cls", "max" or "mean_sqrt_len" (TEI's --pooling names); INVALID_ARGUMENT listing them
// for anything else.
absl::StatusOr<Pooling> ParsePooling(absl::string_view name);
// The name ParsePooling accepts.
const char* PoolingName(Pooling pooling);

// How a checkpoint turns hidden states into a sentence embedding.
struct EmbeddingConfig {
  Pooling pooling = Pooling::kMean;
  bool normalize = false;  // a sentence_transformers.models.Normalize module follows the pooling
  // sentence_bert_config.json's max_seq_length: sentence-transformers truncates inputs to it.
  std::optional<int64_t> max_seq_length;
  // The pooling config's word_embedding_dimension (the hidden size it was saved for); 0 if absent.
  int64_t word_embedding_dimension = 0;
  // False when the checkpoint has no modules.json: the fields above are then defaults (mean
  // pooling, no normalisation, what sentence-transformers itself uses for a plain HF model), and
  // a caller may prefer to ask the user for a pooling mode, as TEI does.
  bool from_files = false;
  // config_sentence_transformers.json's `prompts` (name -> text put before each input text) and
  // `default_prompt_name` (used when a request names none; empty: none), as
  // SentenceTransformer.encode applies them.
  std::map<std::string, std::string> prompts;
  std::string default_prompt_name;
  // The Pooling config's include_prompt: false pools without the prompt's tokens.
  bool include_prompt = true;
};

// The text to put before each input for a request naming prompt `name` ("": the default prompt,
// if any): "" when none applies. INVALID_ARGUMENT for a name that is not one of the prompts
// (listing them); FAILED_PRECONDITION when a prompt applies (even an empty one: sentence-transformers
// then drops [CLS]) and the pooling excludes its tokens (include_prompt false), which bertshard does
// not do yet.
absl::StatusOr<std::string> PromptFor(const EmbeddingConfig& config, const std::string& name);

// Reads `checkpoint_dir`/modules.json, the Pooling module's `<path>/config.json`,
// sentence_bert_config.json and config_sentence_transformers.json (both optional). INVALID_ARGUMENT, naming the file,
// for malformed JSON, a Pooling config without exactly one supported mode set (weighted mean and last-token pooling are
// named as unsupported), modules.json without a Pooling module, or any module besides Transformer, Pooling and
// Normalize (e.g. Dense): those would change the vectors, and ignoring them would serve wrong embeddings. Without
// modules.json: defaults, from_files = false. Each file is read through `dir`'s descriptor, a regular file of at most
// its max_json_bytes (a FIFO or a sparse giant is INVALID_ARGUMENT at once; common/checkpoint_dir.h).
absl::StatusOr<EmbeddingConfig> ReadEmbeddingConfig(const common::CheckpointDir& dir);
// As above, `checkpoint_dir` opened unconfined.
absl::StatusOr<EmbeddingConfig> ReadEmbeddingConfig(const std::string& checkpoint_dir);

// One vector of `dim` floats per row of `hidden` ([rows, seq, dim] row-major), pooled over the
// positions where `attention_mask` ([rows, seq], values 0 or 1) is 1, exactly as
// sentence-transformers' Pooling (then Normalize, when `normalize`) computes it, but accumulated
// in double:
//   kMean        sum(h * mask) / max(sum(mask), 1e-9)
//   kCls         h[0] (the mask is not consulted)
//   kMax         max over positions, with masked positions taking -1e9
//   kMeanSqrtLen sum(h * mask) / sqrt(max(sum(mask), 1e-9))
//   normalize    x / max(||x||_2, 1e-12)
// A row whose mask is all zeros gives no NaN: zeros for the means, -1e9 everywhere for kMax (what
// sentence-transformers returns). INVALID_ARGUMENT for rows < 0, seq < 1, dim < 1, null buffers or
// mask values other than 0 and 1.
absl::StatusOr<std::vector<std::vector<float>>> Pool(const float* hidden, int64_t rows, int64_t seq, int64_t dim,
                                                     const int64_t* attention_mask, Pooling pooling, bool normalize);
// The same, checking that `hidden` holds rows * seq * dim values and `attention_mask` rows * seq.
absl::StatusOr<std::vector<std::vector<float>>> Pool(absl::Span<const float> hidden, int64_t rows, int64_t seq,
                                                     int64_t dim, absl::Span<const int64_t> attention_mask,
                                                     Pooling pooling, bool normalize);

// Cosine similarity as sentence-transformers' util.cos_sim: each vector divided by
// max(||v||_2, 1e-12), then the dot product (so a zero vector gives 0). NaN when the lengths
// differ: there is no meaningful answer, and NaN shows in a printed matrix.
double Cosine(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace bertshard::serving

#endif  // BERTSHARD_SERVING_POOLING_H_
