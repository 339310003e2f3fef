#include "checkpoint/checkpoint.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace bertshard::checkpoint {
namespace {

bool Exists(const std::string& path) { return std::ifstream(path).good(); }

}  // namespace

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& directory) {
  auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
  ckpt->directory_ = directory;
  const std::string single = directory + "/model.safetensors";
  const std::string index_path = directory + "/model.safetensors.index.json";
  std::vector<std::string> shard_names;
  if (Exists(single)) {
    shard_names.push_back("model.safetensors");
  } else if (Exists(index_path)) {
    std::ifstream in(index_path);
    std::stringstream text;
    text << in.rdbuf();
    const auto index = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
        !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, " is not a safetensors index (needs a weight_map object)"));
    }
    for (const auto& [tensor, file] : index["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor ", tensor,
                                                       " maps to a bad shard file name"));
      }
      const std::string name = file.get<std::string>();
      if (std::find(shard_names.begin(), shard_names.end(), name) == shard_names.end()) shard_names.push_back(name);
    }
  } else {
    return absl::NotFoundError(absl::StrCat("checkpoint ", directory,
                                            " has neither model.safetensors nor model.safetensors.index.json"));
  }
  for (const std::string& name : shard_names) {
    auto file = SafetensorsFile::Open(directory + "/" + name);
    if (!file.ok()) return file.status();
    for (const auto& [tensor, info] : (*file)->tensors()) {
      if (!ckpt->index_.emplace(tensor, file->get()).second) {
        return absl::InvalidArgumentError(absl::StrCat("checkpoint ", directory, ": tensor ", tensor,
                                                       " is stored in more than one shard"));
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
  for (const std::string& candidate : tried) {
    auto it = index_.find(candidate);
    if (it != index_.end()) return TensorLocation{it->second, it->second->Find(candidate)};
  }
  return absl::NotFoundError(absl::StrCat("checkpoint ", directory_, " has no tensor ",
                                          absl::StrJoin(tried, " or ")));
}

uint64_t Checkpoint::bytes_read() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->bytes_read();
  return total;
}

}  // namespace bertshard::checkpoint
