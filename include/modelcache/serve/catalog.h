// The catalog of `modelcache serve`: which models a node serves, and the
// files each is made of.
//
//   {"models": [
//     {"id": "sdxl", "files": ["sdxl/unet.safetensors",
//     "sdxl/vae.safetensors"],
//      "aliases": ["sd"], "pinned": true, "priority": 10},
//     {"id": "tiny", "files": ["tiny.safetensors"]}
//   ]}
//
// (The same layout as the runtime's model registry, with `priority` in place
// of `size_bytes`.) Clients name models by id or alias, never by path. An id
// or alias is 1 to 128 characters of [A-Za-z0-9._-], starts with a letter or
// digit and holds no "..". Files are paths relative to the daemon's model
// root: not absolute, no "." or ".." component, no empty component, at most
// 1024 bytes each and 32 KiB for one model's list, 1 to 100 per model, none
// twice. `pinned` (default false) keeps the model resident: the daemon loads
// it at start and never evicts it. `priority` (an integer from -1000 to
// 1000, default 0) orders the loads waiting for a load slot (higher first,
// then first come) and the loading of pinned models at start. Unknown keys,
// wrong types and names used twice are errors.
#ifndef MODELCACHE_SERVE_CATALOG_H_
#define MODELCACHE_SERVE_CATALOG_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "modelcache/base/errors.h"

namespace modelcache::serve {

struct CatalogModel {
  std::string id;
  std::vector<std::string> files;
  std::vector<std::string> aliases;
  bool pinned = false;
  int priority = 0;

  bool operator==(const CatalogModel&) const = default;
};

// A catalog that is not valid (code kInvalidData). The message names the
// source and the model: "catalog.json: model 'x': file '../a' has a '..'
// component".
class CatalogError : public Error {
 public:
  explicit CatalogError(const std::string& message)
      : Error(ErrorCode::kInvalidData, message) {}
};

// Whether `id` may name a model (see the top of this file).
bool IsValidModelId(std::string_view id);

class Catalog {
 public:
  // Parses and validates catalog JSON text; `source` names it in errors.
  // Throws CatalogError.
  static Catalog Parse(std::string_view text, const std::string& source);
  // Reads the file at `path` (at most 16 MiB) and parses it. Throws
  // CatalogError, also when the file cannot be read.
  static Catalog FromFile(const std::string& path);

  // The model `name` (an id or an alias) names, or null.
  const CatalogModel* Find(std::string_view name) const;
  // In the file's order.
  const std::vector<CatalogModel>& models() const { return models_; }

 private:
  std::vector<CatalogModel> models_;
  std::map<std::string, size_t, std::less<>> names_;  // id or alias -> index
};

struct CatalogCheck {
  std::string summary;  // one line
  // With a model root, each model in catalog order with the bytes its copy
  // takes in the daemon's budget: every file's data and header memfds, in
  // pages. That is the "bytes" of /v1/models/{id} once it is loaded, what
  // the load throttle moves, and the size_bytes `modelcache replay` wants.
  std::vector<std::pair<std::string, uint64_t>> copy_bytes;
};

// What `modelcache serve --check-catalog` does: validates the catalog at
// `catalog_path` and, when `model_root` is not empty, opens every file
// beneath the root as the daemon would (no symbolic link, never outside it)
// and validates its safetensors header. Throws CatalogError,
// weights::IoError or weights::FormatError naming the file.
CatalogCheck CheckCatalog(const std::string& catalog_path,
                          const std::string& model_root);

}  // namespace modelcache::serve

#endif  // MODELCACHE_SERVE_CATALOG_H_
