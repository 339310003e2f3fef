#include "checkpoint/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace bertshard::checkpoint {
namespace {

// Whether `path` names anything, readable or not: an unreadable file is then reported by the
// open that fails ("Permission denied"), not mistaken for an absent one.
bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& directory) {
  auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
  ckpt->directory_ = directory;
  const std::string single = directory + "/model.safetensors";
  const std::string index_path = directory + "/model.safetensors.index.json";
  std::vector<std::string> shard_names;
  // With both present, the single file wins and the index is not read: transformers'
  // from_pretrained looks for model.safetensors first, and serving the weights HF would load keeps
  // the parity tests' promise (save_pretrained deletes the other form, so both only meet when a
  // directory was assembled by hand).
  if (Exists(single)) {
    shard_names.push_back("model.safetensors");
  } else if (Exists(index_path)) {
    std::ifstream in(index_path);
    std::stringstream text;
    text << in.rdbuf();
    const auto index = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
        !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, " is not a safetensors index (needs a weight_map object)"));
    }
    if (index["weight_map"].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, " has an empty weight_map: it names no shard file"));
    }
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
      if (std::find(shard_names.begin(), shard_names.end(), name) != shard_names.end()) continue;
      shard_names.push_back(name);
      if (!Exists(directory + "/" + name)) missing.push_back(name);
    }
    // All of them at once: a partly copied checkpoint lacks several, and one error per retry would
    // hide how much is missing.
    if (!missing.empty()) {
      return absl::NotFoundError(absl::StrCat(
          "checkpoint ", directory, ": model.safetensors.index.json names shard file", missing.size() == 1 ? " " : "s ",
          absl::StrJoin(missing, ", "), missing.size() == 1 ? ", which is" : ", which are", " missing"));
    }
  } else {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", directory, " has neither model.safetensors nor model.safetensors.index.json"));
  }
  for (const std::string& name : shard_names) {
    auto file = SafetensorsFile::Open(directory + "/" + name);
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
