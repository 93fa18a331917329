// The model registry: what a model id means (its weight files, other names,
// whether it stays pinned, its expected size).
#ifndef MODELCACHE_RUNTIME_REGISTRY_H_
#define MODELCACHE_RUNTIME_REGISTRY_H_

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/base/errors.h"

namespace modelcache::runtime {

struct ModelSpec {
  std::string id;
  std::vector<std::string> files;  // safetensors files, all loaded together
  std::vector<std::string> aliases;
  bool pinned = false;      // never evicted from a device once loaded there
  uint64_t size_bytes = 0;  // optional hint; 0 when unknown
};

// A bad registry: duplicate names, missing fields, unknown keys. The message
// names the file (for FromJsonFile) and the model.
class RegistryError : public Error {
 public:
  explicit RegistryError(const std::string& message)
      : Error(ErrorCode::kInvalidData, message) {}
};

class ModelRegistry {
 public:
  // Adds a model. Throws RegistryError if its id or an alias is already a
  // name in the registry, or it has no files.
  void Add(ModelSpec spec);

  // The model named `name` (an id or an alias), or null.
  const ModelSpec* Find(std::string_view name) const;
  const std::vector<ModelSpec>& models() const { return models_; }

  // Reads {"models": [{"id": "...", "files": ["a.safetensors"],
  // "aliases": [...], "pinned": false, "size_bytes": 0}]}. Relative file
  // paths are relative to the JSON file's folder. Unknown keys, wrong types
  // and duplicates are errors.
  static ModelRegistry FromJsonFile(const std::string& path);

 private:
  std::vector<ModelSpec> models_;
  std::map<std::string, size_t, std::less<>> names_;  // id or alias -> index
};

}  // namespace modelcache::runtime

#endif  // MODELCACHE_RUNTIME_REGISTRY_H_
