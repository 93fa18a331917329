// HAProxy 2.6's consistent hash ring, bounded-load eligibility and map-based
// hash (modelcache/replay/ring.h).
//
// The vectors marked "HAProxy:" were computed by HAProxy 2.6's own functions
// (full_hash, hash_sdbm, chash_server_is_eligible, chash_get_server_hash from
// the lookup on, recalc_server_map), compiled with -fwrapv as HAProxy is,
// over a sorted array standing in for the eb32 tree. The real binary is
// checked in haproxy_ring_test.cc.
#include "modelcache/replay/ring.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "modelcache/base/errors.h"

namespace modelcache::replay {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr size_t kNone = ConsistentHashRing::kNone;

// n1 id 1 weight 1, n2 id 2 weight 2, n3 id 7 weight 1, n4 id 1000 weight 3.
std::vector<RingServer> FourServers() {
  return {{"n1", 1, 1}, {"n2", 2, 2}, {"n3", 7, 1}, {"n4", 1000, 3}};
}

uint32_t Key(const std::string& model) {
  return HaproxySampleKey(model, /*avalanche=*/true);
}

std::vector<size_t> SelectModels(const ConsistentHashRing& ring,
                                 const std::vector<uint32_t>& in_flight) {
  std::vector<size_t> out;
  for (int i = 0; i < 30; ++i) {
    out.push_back(ring.Select(Key("model-" + std::to_string(i)), in_flight));
  }
  return out;
}

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(HaproxyHashTest, FullHashMatchesHaproxy) {
  // HAProxy: full_hash().
  const std::pair<uint32_t, uint32_t> vectors[] = {
      {0u, 2874071335u},          {1u, 881230262u},
      {4096u, 1237450891u},       {4097u, 2761370759u},
      {4294967295u, 2120532354u}, {123456789u, 2578161185u},
  };
  for (const auto& [in, out] : vectors) EXPECT_EQ(HaproxyFullHash(in), out);
}

TEST(HaproxyHashTest, SampleKeysMatchHaproxy) {
  // HAProxy: hash_sdbm(), then full_hash() for the avalanche step.
  struct Vector {
    std::string sample;
    uint32_t sdbm, avalanche;
  };
  const Vector vectors[] = {
      {"", 0u, 2874071335u},
      {"a", 97u, 1830748055u},
      {"model-42", 2012899202u, 1971465063u},
      {"llama-3-8b-instruct", 3030975563u, 2436970149u},
      {"org%2Fmodel-7", 647309726u, 2378174721u},
      {"\xff\x80", 16727873u, 2982246718u},  // bytes, unsigned
  };
  for (const Vector& v : vectors) {
    EXPECT_EQ(HaproxySdbm(v.sample), v.sdbm) << v.sample;
    EXPECT_EQ(HaproxySampleKey(v.sample, false), v.sdbm) << v.sample;
    EXPECT_EQ(HaproxySampleKey(v.sample, true), v.avalanche) << v.sample;
  }
}

TEST(ConsistentHashRingTest, PointsAreSixteenPerWeightAtFullHashOfIdTimes4096) {
  const ConsistentHashRing ring(FourServers());
  ASSERT_EQ(ring.points().size(), 16u * (1 + 2 + 1 + 3));
  // HAProxy: the lowest five points and the highest.
  const std::pair<uint32_t, uint32_t> lowest[] = {{100983832u, 3},
                                                  {131189535u, 2},
                                                  {199387674u, 3},
                                                  {256940359u, 3},
                                                  {372554957u, 3}};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(ring.points()[i].key, lowest[i].first);
    EXPECT_EQ(ring.points()[i].server, lowest[i].second);
  }
  EXPECT_EQ(ring.points().back().key, 4242288623u);
  EXPECT_EQ(ring.points().back().server, 2u);
  // Every point is where the rule says, and each server has 16·w of them.
  std::multiset<uint32_t> expected;
  for (const RingServer& s : FourServers()) {
    for (uint32_t j = 0; j < 16u * s.weight; ++j) {
      expected.insert(HaproxyFullHash(static_cast<uint32_t>(s.id) * 4096 + j));
    }
  }
  std::multiset<uint32_t> actual;
  for (const auto& p : ring.points()) actual.insert(p.key);
  EXPECT_EQ(actual, expected);
}

TEST(ConsistentHashRingTest, OwnersMatchHaproxy) {
  const ConsistentHashRing ring(FourServers());
  // HAProxy: model-0..29.
  const size_t owners[] = {2, 3, 3, 3, 3, 1, 3, 1, 0, 1, 2, 3, 1, 3, 0,
                           1, 0, 3, 3, 3, 1, 3, 1, 1, 3, 1, 3, 3, 0, 1};
  EXPECT_THAT(SelectModels(ring, {}), ElementsAreArray(owners));
}

TEST(ConsistentHashRingTest, TheNearerPointWinsAndATieGoesToThePredecessor) {
  const ConsistentHashRing ring(FourServers());
  // HAProxy: midpoints between consecutive points of two servers go to the
  // lower point's server; one more goes to the upper's.
  const std::pair<uint32_t, size_t> vectors[] = {
      {431555724u, 1}, {431555725u, 3}, {486084279u, 3}, {486084280u, 0},
      {773554914u, 3}, {773554915u, 0}, {860040972u, 1}, {860040973u, 2}};
  for (const auto& [key, server] : vectors) {
    EXPECT_EQ(ring.Owner(key), server) << key;
  }
  // Below the lowest point and above the highest, the ring wraps (HAProxy:
  // both go to n3).
  EXPECT_EQ(ring.Owner(0), 2u);
  EXPECT_EQ(ring.Owner(0xffffffffu), 2u);
}

// The rule as ring.h states it, by brute force over every point: the owner
// is the server of the point at the smallest clockwise distance from the key
// going back (predecessor side, ties included) or forward.
size_t NearestByScan(const ConsistentHashRing& ring, uint32_t key) {
  const auto& points = ring.points();
  size_t best_prev = 0, best_next = 0;
  uint32_t dp = UINT32_MAX, dn = UINT32_MAX;
  bool have_next = false;
  for (size_t i = 0; i < points.size(); ++i) {
    if (points[i].key >= key && (!have_next || points[i].key - key < dn)) {
      dn = points[i].key - key;
      best_next = i;
      have_next = true;
    }
  }
  if (!have_next) {  // wraps to the lowest point
    best_next = 0;
    dn = points[0].key - key;
  }
  best_prev = best_next == 0 ? points.size() - 1 : best_next - 1;
  dp = key - points[best_prev].key;
  return points[dp <= dn ? best_prev : best_next].server;
}

TEST(ConsistentHashRingTest, LookupAgreesWithAScanOverEveryPoint) {
  ConsistentHashRing ring(
      {{"a", 3, 5}, {"b", 11, 1}, {"c", 4, 256}, {"d", 99999, 17}});
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    const uint32_t key = rng();
    ASSERT_EQ(ring.Owner(key), NearestByScan(ring, key)) << key;
  }
  for (const auto& p : ring.points()) {
    ASSERT_EQ(ring.Owner(p.key), p.server);
  }
}

TEST(ConsistentHashRingTest, AvoidWalksToTheNextPointOfAnotherServer) {
  const ConsistentHashRing ring(FourServers());
  // HAProxy: model-0..29 with their owner avoided (a redispatch).
  const size_t avoided[] = {3, 0, 1, 1, 1, 2, 1, 3, 1, 0, 0, 1, 3, 2, 3,
                            0, 3, 1, 2, 1, 3, 1, 3, 3, 2, 3, 1, 1, 1, 3};
  for (int i = 0; i < 30; ++i) {
    const uint32_t key = Key("model-" + std::to_string(i));
    EXPECT_EQ(ring.Select(key, {}, ring.Owner(key)), avoided[i]) << i;
  }
}

TEST(ConsistentHashRingTest, AvoidingTheOnlyServerStillChoosesIt) {
  ConsistentHashRing ring(FourServers());
  ring.SetDown(0);
  ring.SetDown(1);
  ring.SetDown(3);
  EXPECT_EQ(ring.Select(Key("x"), {}, 2), 2u);
}

TEST(ConsistentHashRingTest, SlotsAreTheWeightedShareOfTotAtLeastOne) {
  struct Case {
    int factor;
    std::vector<uint32_t> in_flight;
    std::vector<uint32_t> slots;
  };
  // HAProxy: chash_server_is_eligible's slots.
  const Case cases[] = {
      {125, {0, 0, 0, 0}, {1, 1, 1, 1}},
      {125, {1, 0, 0, 0}, {1, 1, 1, 2}},
      {125, {2, 1, 0, 0}, {1, 2, 1, 3}},
      {125, {1, 3, 1, 2}, {1, 3, 1, 5}},
      {125, {4, 4, 4, 4}, {3, 6, 3, 10}},
      {125, {9, 9, 9, 9}, {6, 14, 6, 21}},
      {150, {1, 3, 1, 2}, {1, 4, 1, 6}},
      {150, {0, 5, 0, 0}, {1, 2, 2, 4}},
      {150, {4, 4, 4, 4}, {3, 8, 3, 12}},
      {150, {9, 9, 9, 9}, {8, 16, 8, 24}},
      {200, {2, 1, 0, 0}, {1, 2, 1, 4}},
      {200, {1, 3, 1, 2}, {2, 4, 3, 7}},
      {200, {4, 4, 4, 4}, {4, 10, 5, 15}},
      {200, {9, 9, 9, 9}, {10, 21, 11, 32}},
  };
  for (const Case& c : cases) {
    const ConsistentHashRing ring(FourServers(), c.factor);
    uint64_t total = 0;
    for (const uint32_t n : c.in_flight) total += n;
    for (size_t s = 0; s < 4; ++s) {
      EXPECT_EQ(ring.Slots(s, total), c.slots[s])
          << "F=" << c.factor << " P=" << total << " server " << s;
      EXPECT_EQ(ring.IsEligible(s, c.in_flight), c.in_flight[s] < c.slots[s]);
    }
  }
}

TEST(ConsistentHashRingTest, BoundedLoadSelectionsMatchHaproxy) {
  struct Case {
    int factor;
    std::vector<uint32_t> in_flight;
    std::vector<size_t> chosen;  // model-0..29
  };
  // HAProxy: chash_get_server_hash with hash_balance_factor set.
  const Case cases[] = {
      {125, {1, 0, 0, 0}, {2, 3, 3, 3, 3, 1, 3, 1, 1, 1, 2, 3, 1, 3, 3,
                           1, 3, 3, 3, 3, 1, 3, 1, 1, 3, 1, 3, 3, 1, 1}},
      {125, {1, 3, 1, 2}, {3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3,
                           3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3}},
      {150, {0, 5, 0, 0}, {2, 3, 3, 3, 3, 2, 3, 3, 0, 0, 2, 3, 3, 3, 0,
                           0, 0, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 0, 3}},
      {150, {4, 4, 4, 4}, {3, 3, 3, 3, 3, 1, 3, 1, 1, 1, 3, 3, 1, 3, 3,
                           1, 3, 3, 3, 3, 1, 3, 1, 1, 3, 1, 3, 3, 1, 1}},
      {200, {4, 4, 4, 4}, {2, 3, 3, 3, 3, 1, 3, 1, 1, 1, 2, 3, 1, 3, 3,
                           1, 3, 3, 3, 3, 1, 3, 1, 1, 3, 1, 3, 3, 1, 1}},
      {200, {9, 9, 9, 9}, {2, 3, 3, 3, 3, 1, 3, 1, 0, 1, 2, 3, 1, 3, 0,
                           1, 0, 3, 3, 3, 1, 3, 1, 1, 3, 1, 3, 3, 0, 1}},
  };

  for (const Case& c : cases) {
    const ConsistentHashRing ring(FourServers(), c.factor);
    EXPECT_THAT(SelectModels(ring, c.in_flight), ElementsAreArray(c.chosen))
        << "F=" << c.factor;
  }
}

TEST(ConsistentHashRingTest, WithNoServerEligibleTheHighestPointWins) {
  // While every server is up the shares add up to tot > P, so some server
  // has room; the walk finds none when the one with room is avoided (or,
  // with stale shares, in rare states). It then passes every point and
  // keeps the server of the highest, whatever its load.
  // HAProxy: F=125, {1,0,1,5} in flight: slots 1,3,1,5, only n2 has room;
  // with n2 avoided every key goes to n3, the highest point's server.
  ConsistentHashRing ring(FourServers(), 125);
  const std::vector<uint32_t> only_n2 = {1, 0, 1, 5};
  EXPECT_FALSE(ring.IsEligible(0, only_n2));
  EXPECT_TRUE(ring.IsEligible(1, only_n2));
  EXPECT_FALSE(ring.IsEligible(2, only_n2));
  EXPECT_FALSE(ring.IsEligible(3, only_n2));
  ASSERT_EQ(ring.points().back().server, 2u);
  for (int i = 0; i < 30; ++i) {
    const uint32_t key = Key("model-" + std::to_string(i));
    EXPECT_EQ(ring.Select(key, only_n2), 1u) << i;
    EXPECT_EQ(ring.Select(key, only_n2, 1), 2u) << i;
  }
  // HAProxy: n3 down, {1,0,0,2}: slots 1,2,-,2, only n2 has room; avoiding
  // it, the highest point is now n4's, which is full.
  ring.SetDown(2);
  ASSERT_EQ(ring.points().back().server, 3u);
  const std::vector<uint32_t> only_n2_again = {1, 0, 0, 2};
  EXPECT_FALSE(ring.IsEligible(3, only_n2_again));
  for (int i = 0; i < 30; ++i) {
    const uint32_t key = Key("model-" + std::to_string(i));
    EXPECT_EQ(ring.Select(key, only_n2_again), 1u) << i;
    EXPECT_EQ(ring.Select(key, only_n2_again, 1), 3u) << i;
  }
}

TEST(ConsistentHashRingTest, CumulativeWeightsStayStaleAfterAServerGoesDown) {
  ConsistentHashRing ring(FourServers(), 150);
  EXPECT_EQ(ring.cumulative_weight(0), 0u);
  EXPECT_EQ(ring.cumulative_weight(1), 16u);
  EXPECT_EQ(ring.cumulative_weight(2), 48u);
  EXPECT_EQ(ring.cumulative_weight(3), 64u);
  EXPECT_EQ(ring.total_effective_weight(), 112u);
  ring.SetDown(1);
  EXPECT_EQ(ring.total_effective_weight(), 80u);
  EXPECT_EQ(ring.cumulative_weight(2), 48u);
  EXPECT_EQ(ring.cumulative_weight(3), 64u);
  // HAProxy, n2 down: slots of n1, n3, n4 (the stale shares add up to 11 of
  // tot = 12 at P = 7), and the selections.
  EXPECT_EQ(ring.Slots(0, 7), 2u);
  EXPECT_EQ(ring.Slots(2, 7), 2u);
  EXPECT_EQ(ring.Slots(3, 7), 7u);
  EXPECT_EQ(ring.Slots(3, 3), 4u);
  EXPECT_EQ(ring.Slots(3, 16), 16u);
  const size_t owners[] = {2, 3, 3, 3, 3, 3, 3, 3, 0, 0, 2, 3, 3, 3, 0,
                           0, 0, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 0, 3};
  EXPECT_THAT(SelectModels(ring, {}), ElementsAreArray(owners));
  const size_t loaded[] = {2, 3, 3, 3, 3, 3, 3, 3, 2, 3, 2, 3, 3, 3, 3,
                           3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3};
  EXPECT_THAT(SelectModels(ring, {1, 0, 0, 0}), ElementsAreArray(loaded));
  EXPECT_THAT(SelectModels(ring, {2, 1, 0, 0}), ElementsAreArray(loaded));
}

TEST(ConsistentHashRingTest, AServerDownAtStartKeepsCumulativeWeightZero) {
  std::vector<RingServer> servers = FourServers();
  servers[1].down_at_start = true;
  ConsistentHashRing ring(servers, 150);
  EXPECT_FALSE(ring.is_up(1));
  EXPECT_EQ(ring.cumulative_weight(1), 0u);
  EXPECT_EQ(ring.cumulative_weight(2), 16u);
  EXPECT_EQ(ring.cumulative_weight(3), 32u);
  ring.SetUp(1);
  EXPECT_EQ(ring.cumulative_weight(1), 0u);
  EXPECT_EQ(ring.total_effective_weight(), 112u);
  // Its share now overlaps n1's: both count from 0. HAProxy: slots at
  // P = 16, and the selections at {2,0,1,1} in flight.
  EXPECT_EQ(ring.Slots(0, 16), 3u);
  EXPECT_EQ(ring.Slots(1, 16), 7u);
  EXPECT_EQ(ring.Slots(2, 16), 4u);
  EXPECT_EQ(ring.Slots(3, 16), 11u);
  const size_t chosen[] = {3, 3, 3, 3, 3, 1, 3, 1, 1, 1, 3, 3, 1, 3, 3,
                           1, 3, 3, 3, 3, 1, 3, 1, 1, 3, 1, 3, 3, 1, 1};
  EXPECT_THAT(SelectModels(ring, {2, 0, 1, 1}), ElementsAreArray(chosen));
}

TEST(ConsistentHashRingTest, SlotArithmeticWrapsIn32BitsAsHaproxyDoes) {
  // 17 servers of weight 256: T = 69632, and (c + e) · remainder overflows
  // 32 bits for the last ones. HAProxy: the 16th server's slots wrap to
  // 4294909711; exact arithmetic would give 4096.
  std::vector<RingServer> servers;
  for (int i = 1; i <= 17; ++i) {
    servers.push_back({"s" + std::to_string(i), i, 256});
  }
  const ConsistentHashRing ring(servers, 150);
  const uint32_t expected[] = {4095, 4096, 4096, 4096,        4096, 4096,
                               4096, 4096, 4095, 4096,        4096, 4096,
                               4096, 4096, 4096, 4294909711u, 4096};
  for (size_t s = 0; s < 17; ++s) {
    EXPECT_EQ(ring.Slots(s, 46419), expected[s]) << s;
  }
}

TEST(ConsistentHashRingTest, DownAndUpMoveOnlyThatServersKeys) {
  ConsistentHashRing ring(FourServers());
  std::vector<size_t> before;
  for (int i = 0; i < 2000; ++i)
    before.push_back(ring.Owner(Key(std::to_string(i))));
  ring.SetDown(1);
  EXPECT_EQ(ring.points().size(), 16u * 5);
  for (int i = 0; i < 2000; ++i) {
    const size_t now = ring.Owner(Key(std::to_string(i)));
    if (before[i] == 1) {
      EXPECT_NE(now, 1u);
    } else {
      EXPECT_EQ(now, before[i]);
    }
  }
  ring.SetUp(1);
  for (int i = 0; i < 2000; ++i) {
    EXPECT_EQ(ring.Owner(Key(std::to_string(i))), before[i]);
  }
}

TEST(ConsistentHashRingTest, EveryServerDownSelectsNone) {
  ConsistentHashRing ring(FourServers(), 150);
  for (size_t s = 0; s < 4; ++s) ring.SetDown(s);
  EXPECT_EQ(ring.up_count(), 0u);
  EXPECT_EQ(ring.Select(Key("m")), kNone);
  EXPECT_EQ(ring.Select(Key("m"), std::vector<uint32_t>{1, 2, 3, 4}), kNone);
}

TEST(ConsistentHashRingTest, IndexOfFindsNames) {
  const ConsistentHashRing ring(FourServers());
  EXPECT_EQ(ring.IndexOf("n3"), 2u);
  EXPECT_EQ(ring.IndexOf("n5"), kNone);
}

TEST(RingValidationTest, RefusesWhatHaproxyRefusesOrCannotPlace) {
  EXPECT_THAT(ErrorOf([] { ConsistentHashRing ring({}); }),
              HasSubstr("no servers"));
  EXPECT_THAT(ErrorOf([] {
                ConsistentHashRing ring({{"a", 1, 1}, {"a", 2, 1}});
              }),
              HasSubstr("name 'a' is used twice"));
  EXPECT_THAT(ErrorOf([] {
                ConsistentHashRing ring({{"a", 1, 1}, {"b", 1, 1}});
              }),
              HasSubstr("id 1 is used by 'a' and 'b'"));
  EXPECT_THAT(ErrorOf([] {
                ConsistentHashRing ring({{"a", 0, 1}});
              }),
              HasSubstr("id 0"));
  EXPECT_THAT(ErrorOf([] {
                ConsistentHashRing ring({{"a", 2147483648LL, 1}});
              }),
              HasSubstr("id 2147483648"));
  EXPECT_THAT(ErrorOf([] {
                ConsistentHashRing ring({{"a", 1, 0}});
              }),
              HasSubstr("weight 0, outside 1-256"));
  EXPECT_THAT(ErrorOf([] {
                ConsistentHashRing ring({{"a", 1, 257}});
              }),
              HasSubstr("weight 257, outside 1-256"));
  EXPECT_THAT(ErrorOf([] {
                ConsistentHashRing ring({{"", 1, 1}});
              }),
              HasSubstr("empty name"));
  EXPECT_THAT(ErrorOf([] {
                ConsistentHashRing ring({{"a", 5, 1}, {"b", 5 + (1 << 20), 1}});
              }),
              HasSubstr("would share their ring points"));
  EXPECT_THAT(ErrorOf([] {
                ConsistentHashRing ring({{"a", 1, 1}}, 100);
              }),
              HasSubstr("more than 100"));
  EXPECT_THAT(ErrorOf([] {
                ConsistentHashRing ring({{"a", 1, 1}}, -5);
              }),
              HasSubstr("more than 100"));
  EXPECT_THAT(ErrorOf([] {
                MapBasedHash map({{"a", 1, 1}, {"a", 2, 1}});
              }),
              HasSubstr("used twice"));
  // The largest id and a weight of 256 are fine; so are ids equal modulo
  // 2^20 plus one.
  ConsistentHashRing ring({{"a", 2147483647, 256}, {"b", 1 << 20, 1}}, 101);
  EXPECT_EQ(ring.points().size(), 16u * 257);
}

TEST(MapBasedHashTest, TablesMatchHaproxy) {
  // HAProxy: recalc_server_map.
  {
    MapBasedHash map(FourServers());
    EXPECT_THAT(map.table(), ElementsAreArray({0, 1, 3, 1, 3, 2, 3}));
    map.SetDown(1);
    EXPECT_THAT(map.table(), ElementsAreArray({0, 3, 2, 3, 3}));
    map.SetDown(0);
    map.SetDown(3);
    EXPECT_THAT(map.table(), ElementsAreArray({2}));
    map.SetDown(2);
    EXPECT_TRUE(map.table().empty());
    EXPECT_EQ(map.Select(12345), kNone);
  }
  {
    // Weights over their gcd, which counts servers down too.
    MapBasedHash map({{"a", 1, 2}, {"b", 2, 4}, {"c", 3, 6}});
    EXPECT_THAT(map.table(), ElementsAreArray({0, 2, 1, 2, 1, 2}));
    map.SetDown(2);
    EXPECT_THAT(map.table(), ElementsAreArray({0, 1, 1}));
  }
  {
    MapBasedHash map({{"a", 1, 100},
                      {"b", 2, 100},
                      {"c", 3, 50},
                      {"d", 4, 256},
                      {"e", 5, 1}});
    ASSERT_EQ(map.table().size(), 507u);
    const uint32_t prefix[] = {0, 3, 1, 3, 2, 3, 0, 3, 1, 3, 0, 3, 1, 3,
                               2, 3, 0, 3, 1, 3, 0, 3, 1, 3, 2, 3, 0, 3,
                               1, 3, 0, 3, 1, 3, 2, 3, 0, 3, 1, 3};
    for (size_t i = 0; i < std::size(prefix); ++i) {
      EXPECT_EQ(map.table()[i], prefix[i]) << i;
    }
    const uint32_t around80[] = {3, 0, 1, 3, 2, 3, 0, 3, 1, 3};
    for (size_t i = 0; i < std::size(around80); ++i) {
      EXPECT_EQ(map.table()[80 + i], around80[i]) << 80 + i;
    }
    EXPECT_EQ(map.table().back(), 4u);
    std::vector<int> counts(5, 0);
    for (const uint32_t s : map.table()) ++counts[s];
    EXPECT_THAT(counts, ElementsAreArray({100, 100, 50, 256, 1}));
  }
}

TEST(MapBasedHashTest, SelectIsTheKeyModuloTheTable) {
  MapBasedHash map(FourServers());
  for (uint32_t key : {0u, 1u, 6u, 7u, 12345u, 0xffffffffu}) {
    EXPECT_EQ(map.Select(key), map.table()[key % 7]) << key;
  }
  EXPECT_EQ(map.Select(0xffffffffu), map.table()[0xffffffffu % 7]);
}

}  // namespace
}  // namespace modelcache::replay
