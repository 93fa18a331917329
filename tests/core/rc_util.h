// What the core's rapidcheck tests share (property_test.cc and the drain
// property, drain_property.h / drain_property_test.cc): a uniform generator
// of small indices and the runner of a replayed counterexample.
#ifndef MODELCACHE_TESTS_CORE_RC_UTIL_H_
#define MODELCACHE_TESTS_CORE_RC_UTIL_H_

#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <functional>
#include <vector>

namespace modelcache::rc_util {

// One of 0 .. n-1, each as likely: rapidcheck's inRange favours small
// values at small sizes, which would leave the last names and kinds rare.
inline rc::Gen<int> AnyBelow(int n) {
  std::vector<int> values(n);
  for (int i = 0; i < n; ++i) values[i] = i;
  return rc::gen::elementOf(values);
}

// Runs `run` (a replayed counterexample) and reports the model's or the
// invariants' complaint as a test failure: RC_FAIL throws outside a
// property too.
inline void ExpectPasses(const std::function<void()>& run) {
  try {
    run();
  } catch (const rc::detail::CaseResult& result) {
    ADD_FAILURE() << result.description;
  }
}

}  // namespace modelcache::rc_util

#endif  // MODELCACHE_TESTS_CORE_RC_UTIL_H_
