#include "modelcache/runtime/registry.h"

#include <filesystem>
#include <fstream>

#include "nlohmann/json.hpp"

namespace modelcache::runtime {

void ModelRegistry::Add(ModelSpec spec) {
  if (spec.id.empty()) throw RegistryError("a model has an empty id");
  if (spec.files.empty()) {
    throw RegistryError("model '" + spec.id + "' has no weight files");
  }
  std::vector<std::string> names = {spec.id};
  names.insert(names.end(), spec.aliases.begin(), spec.aliases.end());
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i].empty()) {
      throw RegistryError("model '" + spec.id + "' has an empty alias");
    }
    auto it = names_.find(names[i]);
    const bool repeated = std::find(names.begin(), names.begin() + i,
                                    names[i]) != names.begin() + i;
    if (it != names_.end() || repeated) {
      throw RegistryError("model '" + spec.id + "': the name '" + names[i] +
                          "' is already taken" +
                          (it != names_.end()
                               ? " by model '" + models_[it->second].id + "'"
                               : ""));
    }
  }
  for (const std::string& name : names) names_.emplace(name, models_.size());
  models_.push_back(std::move(spec));
}

const ModelSpec* ModelRegistry::Find(std::string_view name) const {
  auto it = names_.find(name);
  return it == names_.end() ? nullptr : &models_[it->second];
}

ModelRegistry ModelRegistry::FromJsonFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw RegistryError(path + ": cannot open file");
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw RegistryError(path + ": not valid JSON: " + e.what());
  }
  auto fail = [&](const std::string& problem) -> void {
    throw RegistryError(path + ": " + problem);
  };
  if (!doc.is_object()) fail("expected an object {\"models\": [...]}");
  for (const auto& [key, value] : doc.items()) {
    if (key != "models") fail("unknown key '" + key + "' (expected 'models')");
  }
  if (!doc.contains("models") || !doc["models"].is_array()) {
    fail("'models' must be an array");
  }
  const std::filesystem::path base = std::filesystem::path(path).parent_path();
  ModelRegistry registry;
  size_t index = 0;
  for (const auto& entry : doc["models"]) {
    const std::string where = "models[" + std::to_string(index++) + "]";
    if (!entry.is_object()) fail(where + " is not an object");
    ModelSpec spec;
    for (const auto& [key, value] : entry.items()) {
      if (key == "id" && value.is_string()) {
        spec.id = value.get<std::string>();
      } else if ((key == "files" || key == "aliases") && value.is_array()) {
        for (const auto& item : value) {
          if (!item.is_string()) fail(where + "." + key + " must hold strings");
          std::string text = item.get<std::string>();
          if (key == "files") {
            std::filesystem::path file(text);
            if (file.is_relative()) file = base / file;
            spec.files.push_back(file.lexically_normal().string());
          } else {
            spec.aliases.push_back(std::move(text));
          }
        }
      } else if (key == "pinned" && value.is_boolean()) {
        spec.pinned = value.get<bool>();
      } else if (key == "size_bytes" && value.is_number_unsigned()) {
        spec.size_bytes = value.get<uint64_t>();
      } else if (key == "id" || key == "files" || key == "aliases" ||
                 key == "pinned" || key == "size_bytes") {
        fail(where + "." + key + " has the wrong type");
      } else {
        fail(where + ": unknown key '" + key +
             "' (known: id, files, aliases, pinned, size_bytes)");
      }
    }
    if (spec.id.empty()) fail(where + " has no 'id'");
    try {
      registry.Add(std::move(spec));
    } catch (const RegistryError& e) {
      fail(e.what());
    }
  }
  return registry;
}

}  // namespace modelcache::runtime
