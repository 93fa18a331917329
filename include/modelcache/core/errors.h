// Errors raised by the core cache.
//
// Every failure the cache itself detects is a modelcache::Error carrying an
// ErrorCode, so callers can branch on the kind without parsing messages. A
// loader's or unloader's own exception is passed through unchanged: every
// waiter of a failed load receives that same exception object.
#ifndef MODELCACHE_CORE_ERRORS_H_
#define MODELCACHE_CORE_ERRORS_H_

#include <stdexcept>
#include <string>

namespace modelcache {

enum class ErrorCode {
  // The model is larger than the whole budget; refused before loading.
  kTooLarge,
  // Nothing evictable could make room: every resident byte is leased, pinned
  // or in flight. The message names what holds the memory.
  kCapacity,
  // The deadline passed while waiting for a load, an unload or capacity.
  kTimeout,
  // The key (or alias) is not known where it must be, e.g. pin() of a key
  // that is not resident.
  kNotFound,
  // The arguments are wrong whatever the state, e.g. an alias naming itself,
  // or an alias that would shadow a loaded key.
  kInvalidArgument,
  // The call is not valid in the current state of the calling thread or the
  // cache, e.g. a loader that acquires the key it is loading, which would
  // wait for itself forever.
  kFailedPrecondition,
};

const char* ErrorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace modelcache

#endif  // MODELCACHE_CORE_ERRORS_H_
