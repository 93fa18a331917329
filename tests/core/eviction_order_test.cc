// EvictionOrder on its own, single-threaded: the lazily kept victim order of
// one shard (src/core/eviction_order.h). Records are made by hand and their
// keys (priority, seq) set as a hit would set them, without re-filing.
#include "../../src/core/eviction_order.h"

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace modelcache::detail {
namespace {

class EvictionOrderTest : public ::testing::Test {
 protected:
  Record* Make(const std::string& key, double priority, uint64_t seq) {
    records_.push_back(std::make_unique<Record>(key, records_.size() + 1, 0));
    Record* r = records_.back().get();
    r->priority = priority;
    r->seq = seq;
    return r;
  }
  // What a hit does: a new key, the entry left where it was.
  static void Touch(Record* r, double priority, uint64_t seq) {
    r->priority = priority;
    r->seq = seq;
  }
  // The keys of the usable records, in the order FirstWhere finds them when
  // each found one is then skipped.
  std::vector<std::string> Drain(const std::set<std::string>& unusable = {}) {
    std::set<std::string> taken = unusable;
    std::vector<std::string> keys;
    while (Record* r = order_.FirstWhere(
               [&](const Record& c) { return taken.count(c.key) == 0; })) {
      keys.push_back(r->key);
      taken.insert(r->key);
    }
    return keys;
  }
  void ExpectConsistent() {
    for (const auto& r : records_) {
      EXPECT_EQ(order_.Check(*r, r->in_order), nullptr) << r->key;
    }
  }

  std::vector<std::unique_ptr<Record>> records_;
  EvictionOrder order_;
};

TEST_F(EvictionOrderTest, LowestPriorityFirstThenLowestSequence) {
  order_.Insert(Make("c", 2, 1));
  order_.Insert(Make("a", 1, 5));
  order_.Insert(Make("b", 1, 7));
  EXPECT_EQ(Drain(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(order_.size(), 3u);
  ExpectConsistent();
}

TEST_F(EvictionOrderTest, ATouchedRecordIsRefiledWhenTheScanReachesIt) {
  Record* a = Make("a", 1, 1);
  Record* b = Make("b", 1, 2);
  Record* c = Make("c", 1, 3);
  for (Record* r : {a, b, c}) order_.Insert(r);
  Touch(a, 1, 4);  // a hit on "a": now the most recent
  EXPECT_EQ(a->order_seq, 1u) << "a hit does not move the entry";
  EXPECT_EQ(order_.FirstWhere([](const Record&) { return true; }), b);
  EXPECT_EQ(a->order_seq, 4u) << "the scan re-filed it";
  EXPECT_EQ(Drain(), (std::vector<std::string>{"b", "c", "a"}));
  ExpectConsistent();
}

TEST_F(EvictionOrderTest, ARefiledRecordThatStillComesFirstIsFound) {
  Record* a = Make("a", 1, 1);
  Record* b = Make("b", 5, 2);
  order_.Insert(a);
  order_.Insert(b);
  Touch(a, 2, 3);  // later than its old key, still before "b"
  EXPECT_EQ(order_.FirstWhere([](const Record&) { return true; }), a);
  ExpectConsistent();
}

TEST_F(EvictionOrderTest, UnusableRecordsKeepTheirPlace) {
  // A leased, pinned or failing record is passed over, and stays where it
  // is: once usable again it is the first victim, as before.
  order_.Insert(Make("a", 1, 1));
  order_.Insert(Make("b", 1, 2));
  order_.Insert(Make("c", 1, 3));
  EXPECT_EQ(Drain({"a"}), (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(Drain(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(order_.size(), 3u);
}

TEST_F(EvictionOrderTest, EraseRemovesOnlyThatRecordAndIsIdempotent) {
  Record* a = Make("a", 1, 1);
  Record* b = Make("b", 1, 2);
  order_.Insert(a);
  order_.Insert(b);
  Touch(a, 3, 9);  // erased by its filed key, not its current one
  order_.Erase(a);
  order_.Erase(a);
  EXPECT_FALSE(a->in_order);
  EXPECT_EQ(order_.size(), 1u);
  EXPECT_EQ(Drain(), (std::vector<std::string>{"b"}));
  ExpectConsistent();
}

TEST_F(EvictionOrderTest, RefileAppliesALowerPriorityAtOnce) {
  // Policies whose priorities can fall (Belady's) re-file on every touch.
  Record* a = Make("a", 5, 1);
  Record* b = Make("b", 3, 2);
  order_.Insert(a);
  order_.Insert(b);
  Touch(a, 1, 3);
  order_.Refile(a);
  EXPECT_EQ(Drain(), (std::vector<std::string>{"a", "b"}));
  ExpectConsistent();
}

TEST_F(EvictionOrderTest, CheckNamesWhatIsWrong) {
  Record* a = Make("a", 2, 2);
  Record* loose = Make("loose", 1, 1);
  order_.Insert(a);
  EXPECT_EQ(order_.Check(*a, true), nullptr);
  EXPECT_STREQ(order_.Check(*a, false), "order membership wrong");
  EXPECT_STREQ(order_.Check(*loose, true), "order membership wrong");
  Touch(a, 1, 1);  // a key below the filed one: the lazy order breaks
  EXPECT_STREQ(order_.Check(*a, true), "order entry ahead of its record");
  loose->in_order = true;  // claims an entry it does not have
  EXPECT_STREQ(order_.Check(*loose, true), "order entry missing");
  loose->in_order = false;
}

TEST_F(EvictionOrderTest, ClearUnfilesEveryRecord) {
  Record* a = Make("a", 1, 1);
  order_.Insert(a);
  order_.Insert(Make("b", 1, 2));
  order_.Clear();
  EXPECT_EQ(order_.size(), 0u);
  EXPECT_FALSE(a->in_order);
  EXPECT_EQ(order_.FirstWhere([](const Record&) { return true; }), nullptr);
}

}  // namespace
}  // namespace modelcache::detail
