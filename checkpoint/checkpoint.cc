#include "checkpoint/checkpoint.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace bertshard::checkpoint {

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& directory) {
  ASSIGN_OR_RETURN(std::shared_ptr<const common::CheckpointDir> dir,
                   common::CheckpointDir::Open(common::ModelRoot(), directory));
  return Open(*dir);
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const common::CheckpointDir& dir) {
  auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
  const std::string& directory = dir.path();
  ckpt->directory_ = directory;
  const std::string index_path = directory + "/model.safetensors.index.json";
  // Every file is opened once, through the directory's descriptor, and mapped from that
  // descriptor: what was checked is what is read.
  std::vector<common::MappableFile> shards;
  // With both present, the single file wins and the index is not read: transformers'
  // from_pretrained looks for model.safetensors first, and serving the weights HF would load keeps
  // the parity tests' promise (save_pretrained deletes the other form, so both only meet when a
  // directory was assembled by hand).
  absl::StatusOr<common::MappableFile> single = dir.OpenForMap("model.safetensors");
  if (single.ok()) {
    shards.push_back(*std::move(single));
  } else if (single.status().code() != absl::StatusCode::kNotFound) {
    return single.status();
  } else {
    absl::StatusOr<std::string> text = dir.ReadSmallFile("model.safetensors.index.json", dir.limits().max_json_bytes);
    if (text.status().code() == absl::StatusCode::kNotFound) {
      return absl::NotFoundError(
          absl::StrCat("checkpoint ", directory, " has neither model.safetensors nor model.safetensors.index.json"));
    }
    if (!text.ok()) return text.status();
    const auto index = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
        !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, " is not a safetensors index (needs a weight_map object)"));
    }
    if (index["weight_map"].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, " has an empty weight_map: it names no shard file"));
    }
    std::vector<std::string> names;    // each shard file once, in the index's order
    std::vector<std::string> missing;  // shard files the index names that are not there
    for (const auto& [tensor, file] : index["weight_map"].items()) {
      // A bare file name in this directory: no path (a separator, "." or "..") may lead elsewhere.
      if (!file.is_string() || file.get<std::string>().empty() ||
          file.get<std::string>().find('/') != std::string::npos || file.get<std::string>() == "." ||
          file.get<std::string>() == "..") {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": tensor ", tensor, " maps to a bad shard file name"));
      }
      const std::string name = file.get<std::string>();
      if (std::find(names.begin(), names.end(), name) != names.end()) continue;
      names.push_back(name);
      absl::StatusOr<common::MappableFile> shard = dir.OpenForMap(name);
      if (shard.ok()) {
        shards.push_back(*std::move(shard));
      } else if (shard.status().code() == absl::StatusCode::kNotFound) {
        missing.push_back(name);
      } else {
        return shard.status();
      }
    }
    // All of them at once: a partly copied checkpoint lacks several, and one error per retry would
    // hide how much is missing.
    if (!missing.empty()) {
      return absl::NotFoundError(absl::StrCat(
          "checkpoint ", directory, ": model.safetensors.index.json names shard file", missing.size() == 1 ? " " : "s ",
          absl::StrJoin(missing, ", "), missing.size() == 1 ? ", which is" : ", which are", " missing"));
    }
  }
  for (const common::MappableFile& shard : shards) {
    auto file = SafetensorsFile::OpenDescriptor(shard.fd.get(), shard.path);
    if (!file.ok()) return file.status();
    for (const auto& [tensor, info] : (*file)->tensors()) {
      if (!ckpt->index_.emplace(tensor, file->get()).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint ", directory, ": tensor ", tensor, " is stored in more than one shard"));
      }
    }
    ckpt->files_.push_back(*std::move(file));
  }
  return ckpt;
}

absl::StatusOr<TensorLocation> Checkpoint::Find(const std::string& name,
                                                const std::vector<std::string>& aliases) const {
  std::vector<std::string> tried = {name};
  tried.insert(tried.end(), aliases.begin(), aliases.end());
  // Checkpoints converted from BERT's TensorFlow original name LayerNorm's parameters gamma and
  // beta; transformers' from_pretrained reads them as weight and bias, and so does this.
  for (size_t i = 0, n = tried.size(); i < n; ++i) {
    for (const auto& [now, legacy] :
         {std::pair<absl::string_view, absl::string_view>{"LayerNorm.weight", "LayerNorm.gamma"},
          {"LayerNorm.bias", "LayerNorm.beta"}}) {
      if (absl::EndsWith(tried[i], now)) {
        tried.push_back(absl::StrCat(tried[i].substr(0, tried[i].size() - now.size()), legacy));
      }
    }
  }
  for (const std::string& candidate : tried) {
    auto it = index_.find(candidate);
    if (it != index_.end()) return TensorLocation{it->second, it->second->Find(candidate)};
  }
  return absl::NotFoundError(absl::StrCat("checkpoint ", directory_, " has no tensor ", absl::StrJoin(tried, " or ")));
}

uint64_t Checkpoint::bytes_read() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->bytes_read();
  return total;
}

}  // namespace bertshard::checkpoint
