// Catalog parsing and validation.
//
// The text is checked for nesting depth (a catalog is three levels deep)
// before it is parsed into a tree, then every model is checked field by
// field; nothing is kept from a catalog with any error.
#include "modelcache/serve/catalog.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "modelcache/base/text.h"
#include "protocol.h"

namespace modelcache::serve {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxCatalogBytes = size_t{16} << 20;
constexpr size_t kMaxPathBytes = 1024;
constexpr size_t kMaxPathsBytes = size_t{32} << 10;
constexpr int kMaxPriority = 1000;
// How much of an untrusted key, id or path a message quotes.
constexpr size_t kQuotedBytes = 80;

// Why `path` may not name a file beneath the root, or "".
std::string PathProblem(const std::string& path) {
  if (path.empty()) return "is empty";
  if (path.size() > kMaxPathBytes) {
    return "is longer than " + std::to_string(kMaxPathBytes) + " bytes";
  }
  if (path.find('\0') != std::string::npos) return "holds a NUL byte";
  if (path.front() == '/')
    return "is absolute (files are relative to the root)";
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    const std::string_view part(path.data() + start, end - start);
    if (part.empty()) return "has an empty component ('//' or a trailing '/')";
    if (part == "..") return "has a '..' component";
    if (part == ".") return "has a '.' component";
    start = end + 1;
  }
  return "";
}

}  // namespace

bool IsValidModelId(std::string_view id) {
  return protocol::IsValidModelId(id);
}

Catalog Catalog::Parse(std::string_view text, const std::string& source) {
  const auto error = [&](const std::string& what) {
    return CatalogError(source + ": " + what);
  };
  if (text.size() > kMaxCatalogBytes) {
    throw error("larger than " + std::to_string(kMaxCatalogBytes) + " bytes");
  }
  if (!protocol::NestingAtMost(text, 8)) throw error("nests too deeply");
  // The lexer would take a NUL for the end of the input.
  if (text.find('\0') != std::string_view::npos) {
    throw error("not valid JSON: a NUL byte");
  }
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    std::string what = e.what();
    const size_t colon = what.find(": ");
    if (what.rfind("[json.exception.", 0) == 0 && colon != std::string::npos) {
      what = what.substr(colon + 2);
    }
    throw error("not valid JSON: " + what);
  }
  if (!doc.is_object()) throw error("must be a JSON object");
  for (const auto& [key, value] : doc.items()) {
    if (key != "models") {
      throw error("unknown key " + base::Quoted(key, kQuotedBytes));
    }
  }
  const auto models = doc.find("models");
  if (models == doc.end() || !models->is_array()) {
    throw error("needs \"models\": a list of models");
  }

  Catalog catalog;
  size_t index = 0;
  for (const json& entry : *models) {
    const std::string where = "model #" + std::to_string(index + 1);
    if (!entry.is_object()) throw error(where + " is not an object");
    const auto id_it = entry.find("id");
    if (id_it == entry.end() || !id_it->is_string()) {
      throw error(where + " has no \"id\" string");
    }
    CatalogModel model;
    model.id = id_it->get<std::string>();
    const std::string name = "model " + base::Quoted(model.id, kQuotedBytes);
    if (!IsValidModelId(model.id)) {
      throw error(name +
                  ": not a valid id (1 to 128 characters of [A-Za-z0-9._-], "
                  "starting with a letter or digit, without '..')");
    }
    for (const auto& [key, value] : entry.items()) {
      if (key == "id") continue;
      if (key == "files") {
        if (!value.is_array()) throw error(name + ": \"files\" is not a list");
        size_t total = 0;
        std::set<std::string> seen;
        for (const json& file : value) {
          if (!file.is_string()) {
            throw error(name + ": \"files\" holds something not a string");
          }
          std::string path = file.get<std::string>();
          if (const std::string why = PathProblem(path); !why.empty()) {
            throw error(name + ": file " + base::Quoted(path, kQuotedBytes) +
                        " " + why);
          }
          if (!seen.insert(path).second) {
            throw error(name + ": file " + base::Quoted(path, kQuotedBytes) +
                        " is listed twice");
          }
          total += path.size();
          model.files.push_back(std::move(path));
        }
        if (model.files.empty() ||
            model.files.size() > protocol::kMaxFilesPerModel) {
          throw error(name + ": needs 1 to " +
                      std::to_string(protocol::kMaxFilesPerModel) +
                      " files, has " + std::to_string(model.files.size()));
        }
        if (total > kMaxPathsBytes) {
          throw error(name + ": its file names take more than " +
                      std::to_string(kMaxPathsBytes) + " bytes");
        }
      } else if (key == "aliases") {
        if (!value.is_array()) {
          throw error(name + ": \"aliases\" is not a list");
        }
        for (const json& alias : value) {
          if (!alias.is_string() || !IsValidModelId(alias.get<std::string>())) {
            throw error(
                name + ": alias " +
                (alias.is_string()
                     ? base::Quoted(alias.get<std::string>(), kQuotedBytes)
                     : std::string("(not a string)")) +
                " is not a valid id");
          }
          model.aliases.push_back(alias.get<std::string>());
        }
      } else if (key == "pinned") {
        if (!value.is_boolean()) {
          throw error(name + ": \"pinned\" is not true or false");
        }
        model.pinned = value.get<bool>();
      } else if (key == "priority") {
        if (!value.is_number_integer() ||
            value.get<int64_t>() < -kMaxPriority ||
            value.get<int64_t>() > kMaxPriority) {
          throw error(name +
                      ": \"priority\" must be an integer from -1000 "
                      "to 1000");
        }
        model.priority = static_cast<int>(value.get<int64_t>());
      } else {
        throw error(name + ": unknown key " + base::Quoted(key, kQuotedBytes) +
                    " (known: id, files, aliases, pinned, priority)");
      }
    }
    if (model.files.empty()) throw error(name + ": has no \"files\"");
    const size_t position = catalog.models_.size();
    if (!catalog.names_.emplace(model.id, position).second) {
      throw error(name + ": the name is used twice");
    }
    for (const std::string& alias : model.aliases) {
      if (!catalog.names_.emplace(alias, position).second) {
        throw error(name + ": alias " + base::Quoted(alias, kQuotedBytes) +
                    " is used twice");
      }
    }
    catalog.models_.push_back(std::move(model));
    ++index;
  }
  return catalog;
}

Catalog Catalog::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CatalogError(path + ": cannot be read");
  std::string text;
  char buffer[1 << 16];
  while (in.read(buffer, sizeof(buffer)) || in.gcount() > 0) {
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxCatalogBytes) {
      throw CatalogError(path + ": larger than " +
                         std::to_string(kMaxCatalogBytes) + " bytes");
    }
  }
  if (in.bad()) throw CatalogError(path + ": read failed");
  return Parse(text, path);
}

const CatalogModel* Catalog::Find(std::string_view name) const {
  const auto it = names_.find(name);
  return it == names_.end() ? nullptr : &models_[it->second];
}

}  // namespace modelcache::serve
