#include "modelcache/serve/errors.h"

#include <array>
#include <utility>

namespace modelcache::serve {
namespace {

constexpr std::array<std::pair<ServeCode, const char*>, 8> kNames = {{
    {ServeCode::kNotFound, "NOT_FOUND"},
    {ServeCode::kTooLarge, "TOO_LARGE"},
    {ServeCode::kCapacity, "CAPACITY"},
    {ServeCode::kTimeout, "TIMEOUT"},
    {ServeCode::kLoadFailed, "LOAD_FAILED"},
    {ServeCode::kBusy, "BUSY"},
    {ServeCode::kInvalid, "INVALID"},
    {ServeCode::kUnavailable, "UNAVAILABLE"},
}};

}  // namespace

const char* ServeCodeName(ServeCode code) {
  for (const auto& [c, name] : kNames) {
    if (c == code) return name;
  }
  return "UNKNOWN";
}

std::optional<ServeCode> ParseServeCode(std::string_view name) {
  for (const auto& [c, n] : kNames) {
    if (name == n) return c;
  }
  return std::nullopt;
}

ErrorCode CoreCodeOf(ServeCode code) {
  switch (code) {
    case ServeCode::kNotFound:
      return ErrorCode::kNotFound;
    case ServeCode::kTooLarge:
      return ErrorCode::kTooLarge;
    case ServeCode::kCapacity:
      return ErrorCode::kCapacity;
    case ServeCode::kTimeout:
      return ErrorCode::kTimeout;
    case ServeCode::kLoadFailed:
      return ErrorCode::kIo;
    case ServeCode::kBusy:
    case ServeCode::kUnavailable:
      return ErrorCode::kUnavailable;
    case ServeCode::kInvalid:
      return ErrorCode::kInvalidArgument;
  }
  return ErrorCode::kInvalidArgument;
}

}  // namespace modelcache::serve
