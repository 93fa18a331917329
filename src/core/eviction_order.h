// EvictionOrder: one shard's records in the order they should be evicted.
//
// Design note
// -----------
// Entries are (priority, seq, record) in an ordered set, lowest first. A
// record carries two keys: its current one (Record::priority, Record::seq),
// which every hit rewrites under the shard mutex, and the one it is filed
// under (Record::order_priority, order_seq). A hit touches only the current
// key; the entry is moved ("re-filed") lazily, when a scan for a victim
// reaches it. For a policy whose priorities never decrease as a record is
// used again (LRU, GreedyDual with a rising L), the filed key is never
// greater than the current one, so the first entry whose record is usable
// and whose filed key is current is the true minimum: every entry before it
// was either unusable or moved to a later place. Policies that may lower a
// priority (Belady's) re-file at once on every touch (Refile), which keeps
// the same invariant.
//
// A record that is skipped (leased, pinned, or its unload failed) keeps its
// entry where it is: nothing but Erase removes an entry, which is how a
// failed unload keeps its place in the order.
//
// Invariant (Check): a record is filed iff its owner says it should be; its
// entry is in the set under its filed key; the filed key is <= its current
// key. Single-threaded: the shard mutex guards every call.
#ifndef MODELCACHE_SRC_CORE_EVICTION_ORDER_H_
#define MODELCACHE_SRC_CORE_EVICTION_ORDER_H_

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <set>

#include "record.h"

namespace modelcache::detail {

class EvictionOrder {
 public:
  // Files `r` under its current key. REQUIRES: `r` is not filed.
  void Insert(Record* r);
  // Removes the entry of `r`; does nothing if it is not filed.
  void Erase(Record* r);
  // Moves the entry of `r` to its current key now. REQUIRES: `r` is filed.
  void Refile(Record* r);

  // The first record, in order of current keys, for which `usable` is true,
  // or nullptr. Re-files the stale entries it meets on the way.
  template <typename Usable>
  Record* FirstWhere(Usable&& usable);

  // Calls f(record) for every filed record, in filed order (for a policy
  // that ranks at eviction time, where the order does not matter).
  template <typename F>
  void ForEach(F&& f) const {
    for (const Entry& e : entries_) f(e.record);
  }

  // Null when the order agrees with `r` (filed iff `should_be_filed`, under
  // a key no greater than its current one), else what is wrong.
  const char* Check(const Record& r, bool should_be_filed) const;

  size_t size() const { return entries_.size(); }
  void Clear();

 private:
  struct Entry {
    double priority;
    uint64_t seq;
    Record* record;
    bool operator<(const Entry& o) const {
      if (priority != o.priority) return priority < o.priority;
      if (seq != o.seq) return seq < o.seq;
      return record < o.record;
    }
  };
  static bool Stale(const Entry& e) {
    return e.priority != e.record->priority || e.seq != e.record->seq;
  }

  std::set<Entry> entries_;
};

template <typename Usable>
Record* EvictionOrder::FirstWhere(Usable&& usable) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    Record* r = it->record;
    if (Stale(*it)) {
      // Touched since it was filed: re-file it at its current key, which is
      // larger than the old one but may still precede `next`, so the scan
      // resumes from whichever of the two comes first.
      auto next = std::next(it);
      auto node = entries_.extract(it);
      node.value() = Entry{r->priority, r->seq, r};
      r->order_priority = r->priority;
      r->order_seq = r->seq;
      auto refiled = entries_.insert(std::move(node)).position;
      it = (next == entries_.end() || *refiled < *next) ? refiled : next;
      continue;
    }
    if (usable(*r)) return r;
    ++it;
  }
  return nullptr;
}

}  // namespace modelcache::detail

#endif  // MODELCACHE_SRC_CORE_EVICTION_ORDER_H_
