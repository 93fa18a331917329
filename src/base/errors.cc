#include "modelcache/base/errors.h"

namespace modelcache {

const char* ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kTooLarge:
      return "too_large";
    case ErrorCode::kCapacity:
      return "capacity";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kNotFound:
      return "not_found";
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kFailedPrecondition:
      return "failed_precondition";
    case ErrorCode::kInvalidData:
      return "invalid_data";
    case ErrorCode::kIo:
      return "io";
    case ErrorCode::kUnavailable:
      return "unavailable";
  }
  return "unknown";
}

}  // namespace modelcache
