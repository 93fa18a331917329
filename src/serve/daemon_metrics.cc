// The daemon's metric tables: the names of acquire results and of
// disconnect reasons (the series are rendered in http_api.cc).
#include "daemon_internal.h"

namespace modelcache::serve {

using detail::Disconnect;
using detail::Result;

namespace detail {

const char* ResultName(Result result) {
  switch (result) {
    case Result::kHit:
      return "hit";
    case Result::kLoaded:
      return "loaded";
    case Result::kNotFound:
      return "not_found";
    case Result::kTooLarge:
      return "too_large";
    case Result::kCapacity:
      return "capacity";
    case Result::kTimeout:
      return "timeout";
    case Result::kLoadFailed:
      return "load_failed";
    case Result::kBusy:
      return "busy";
    case Result::kInvalid:
      return "invalid";
    case Result::kUnavailable:
    case Result::kCount:
      break;
  }
  return "unavailable";
}

Result ResultOf(ServeCode code) {
  switch (code) {
    case ServeCode::kNotFound:
      return Result::kNotFound;
    case ServeCode::kTooLarge:
      return Result::kTooLarge;
    case ServeCode::kCapacity:
      return Result::kCapacity;
    case ServeCode::kTimeout:
      return Result::kTimeout;
    case ServeCode::kLoadFailed:
      return Result::kLoadFailed;
    case ServeCode::kBusy:
      return Result::kBusy;
    case ServeCode::kInvalid:
      return Result::kInvalid;
    case ServeCode::kUnavailable:
      return Result::kUnavailable;
  }
  return Result::kInvalid;
}

const char* DisconnectName(Disconnect reason) {
  switch (reason) {
    case Disconnect::kClosed:
      return "closed";
    case Disconnect::kProcessExit:
      return "process_exit";
    case Disconnect::kSlowReader:
      return "slow_reader";
    case Disconnect::kRefused:
      return "refused";
    case Disconnect::kError:
      return "error";
    case Disconnect::kShutdown:
    case Disconnect::kCount:
      break;
  }
  return "shutdown";
}

}  // namespace detail

}  // namespace modelcache::serve
