// Fuzz target: bytes -> InferRequest (binary protobuf, as gRPC delivers it) -> the coordinator's
// input decoding (server/input_preparation.h PrepareInput) for a small masked-LM plan with a vocabulary:
// token batches of any shape and values, texts and text pairs, truncation on or off. Every
// request must become a batch or an INVALID_ARGUMENT, never a crash.
#include <cstdint>
#include <string>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "planner/planner.h"
#include "server/input_preparation.h"
#include "tokenizer/wordpiece.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Protobuf logs every string field with invalid UTF-8 it parses: noise at millions of inputs.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
    return true;
  }();
  (void)quiet;
  using bertshard::v1::ShardPlan;
  static const ShardPlan* plan = [] {
    bertshard::v1::PlanRequest request;
    request.set_variant(bertshard::v1::BERT_FOR_MASKED_LM);
    auto* c = request.mutable_config();
    c->set_vocab_size(18);
    c->set_hidden_size(8);
    c->set_num_hidden_layers(2);
    c->set_num_attention_heads(2);
    c->set_intermediate_size(16);
    c->set_max_position_embeddings(16);
    c->set_type_vocab_size(2);
    return new ShardPlan(bertshard::planner::Plan(request).value());
  }();
  static const bertshard::server::JobAssets* assets = [] {
    auto* a = new bertshard::server::JobAssets();
    std::vector<std::string> vocab = {"[PAD]", "[UNK]", "[CLS]",  "[SEP]", "[MASK]", "the", "a", "##s", "##ing",
                                      "play",  "un",    "##able", "é",     "中",     "!",   ",", "1",   "##2"};
    a->tokenizer = bertshard::tokenizer::WordPieceTokenizer::FromVocab(vocab, {}).value();
    a->cls_id = 2;
    a->sep_id = 3;
    a->pad_id = 0;
    a->mask_id = 4;
    return a;
  }();
  bertshard::v1::InferRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  (void)bertshard::server::PrepareInput(request.has_tokens() ? &request.tokens() : nullptr,
                                        request.has_text() ? &request.text() : nullptr, *plan, *assets,
                                        plan->config().max_position_embeddings(), request.truncate());
  return 0;
}
