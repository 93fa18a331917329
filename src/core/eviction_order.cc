#include "eviction_order.h"

#include <cassert>

namespace modelcache::detail {

void EvictionOrder::Insert(Record* r) {
  assert(!r->in_order);
  r->order_priority = r->priority;
  r->order_seq = r->seq;
  entries_.insert(Entry{r->priority, r->seq, r});
  r->in_order = true;
}

void EvictionOrder::Erase(Record* r) {
  if (!r->in_order) return;
  const size_t erased =
      entries_.erase(Entry{r->order_priority, r->order_seq, r});
  assert(erased == 1);
  (void)erased;
  r->in_order = false;
}

void EvictionOrder::Refile(Record* r) {
  Erase(r);
  Insert(r);
}

const char* EvictionOrder::Check(const Record& r, bool should_be_filed) const {
  if (r.in_order != should_be_filed) return "order membership wrong";
  if (!r.in_order) return nullptr;
  if (entries_.count(
          Entry{r.order_priority, r.order_seq, const_cast<Record*>(&r)}) != 1) {
    return "order entry missing";
  }
  if (r.order_priority > r.priority ||
      (r.order_priority == r.priority && r.order_seq > r.seq)) {
    return "order entry ahead of its record";
  }
  return nullptr;
}

void EvictionOrder::Clear() {
  for (const Entry& e : entries_) e.record->in_order = false;
  entries_.clear();
}

}  // namespace modelcache::detail
