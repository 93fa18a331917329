// Small formatting helpers shared by the core's error messages.
#ifndef MODELCACHE_SRC_CORE_FORMAT_H_
#define MODELCACHE_SRC_CORE_FORMAT_H_

#include <exception>
#include <string>

#include "modelcache/base/bytes.h"

namespace modelcache::detail {

using ::modelcache::FormatBytes;

// The message of an exception, for events and error text.
inline std::string DescribeException(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace modelcache::detail

#endif  // MODELCACHE_SRC_CORE_FORMAT_H_
