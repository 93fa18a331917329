// Aliases: names that resolve to a canonical key, one level deep. AddAlias
// and RemoveAlias change the alias table and the alias's slot in its shard
// map as one step under alias_mu_ (see "Aliases" in cache_internal.h);
// lookups never take that mutex, they resolve an alias slot in the shard
// map (Canonical, lifecycle.cc), as Resolve does.
#include <cassert>
#include <string>
#include <string_view>
#include <vector>

#include "cache_internal.h"

namespace modelcache::detail {

void CacheCore::AddAlias(std::string_view alias, std::string_view canonical) {
  const std::string alias_key(alias);
  const std::string canonical_key(canonical);
  if (alias == canonical) {
    throw Error(ErrorCode::kInvalidArgument,
                "alias '" + alias_key + "' names itself");
  }
  base::MutexLock aliases(&alias_mu_);
  if (auto it = alias_target_.find(canonical_key); it != alias_target_.end()) {
    throw Error(ErrorCode::kInvalidArgument,
                "cannot alias '" + alias_key + "' to '" + canonical_key +
                    "': '" + canonical_key + "' is itself an alias of '" +
                    it->second + "'");
  }
  if (auto it = aliases_of_.find(alias_key); it != aliases_of_.end()) {
    throw Error(ErrorCode::kInvalidArgument,
                "cannot make '" + alias_key + "' an alias: alias '" +
                    it->second.front() + "' names it");
  }
  {
    Shard& shard = ShardFor(alias);
    base::MutexLock lock(&shard.mu);
    auto it = shard.map.find(alias);
    if (it != shard.map.end() && it->second.record) {
      throw Error(
          ErrorCode::kInvalidArgument,
          "cannot alias '" + alias_key + "': a model is loaded under that key");
    }
    if (it == shard.map.end()) {
      shard.map.emplace(alias_key, Slot{nullptr, canonical_key});
    } else {
      it->second.alias_of = canonical_key;
    }
  }
  if (auto old = alias_target_.find(alias_key); old != alias_target_.end()) {
    auto& names = aliases_of_[old->second];
    std::erase(names, alias_key);
    if (names.empty()) aliases_of_.erase(old->second);
  }
  alias_target_[alias_key] = canonical_key;
  aliases_of_[canonical_key].push_back(alias_key);
}

bool CacheCore::RemoveAlias(std::string_view alias) {
  const std::string alias_key(alias);
  base::MutexLock aliases(&alias_mu_);
  auto target = alias_target_.find(alias_key);
  if (target == alias_target_.end()) return false;
  {
    Shard& shard = ShardFor(alias);
    base::MutexLock lock(&shard.mu);
    auto it = shard.map.find(alias);
    assert(it != shard.map.end() && !it->second.record);
    shard.map.erase(it);
  }
  auto& names = aliases_of_[target->second];
  std::erase(names, alias_key);
  if (names.empty()) aliases_of_.erase(target->second);
  alias_target_.erase(target);
  return true;
}

std::string CacheCore::Resolve(std::string_view key) {
  std::string storage;
  return std::string(Canonical(key, &storage));
}

}  // namespace modelcache::detail
