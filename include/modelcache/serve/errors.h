// The errors of `modelcache serve` and its clients.
//
// Every error reply of the lease protocol carries one of these codes and a
// message. A client raises it as a ServeError, which is a modelcache::Error
// whose ErrorCode is the core's nearest one, so code that already catches
// modelcache::Error by code keeps working; ServeCode says more.
#ifndef MODELCACHE_SERVE_ERRORS_H_
#define MODELCACHE_SERVE_ERRORS_H_

#include <optional>
#include <string>
#include <string_view>

#include "modelcache/base/errors.h"

namespace modelcache::serve {

enum class ServeCode {
  kNotFound,    // NOT_FOUND: no such model in the catalog, no such lease
  kTooLarge,    // TOO_LARGE: the model is larger than the whole budget
  kCapacity,    // CAPACITY: nothing evictable; the message names the holders
  kTimeout,     // TIMEOUT: the acquire's timeout passed
  kLoadFailed,  // LOAD_FAILED: reading or validating the files failed
  kBusy,        // BUSY: a limit of the daemon was reached
  kInvalid,     // INVALID: a malformed or unknown request
  // UNAVAILABLE: the daemon is unreachable or shutting down; or, with a
  // cause, the model is: its files cannot be opened or are not valid (the
  // message names the file), and no copy of it is resident.
  kUnavailable,
};

// The protocol's name of a code: "NOT_FOUND", "TOO_LARGE", "CAPACITY",
// "TIMEOUT", "LOAD_FAILED", "BUSY", "INVALID", "UNAVAILABLE".
const char* ServeCodeName(ServeCode code);
// The code with that protocol name, if any.
std::optional<ServeCode> ParseServeCode(std::string_view name);
// The core's nearest code: kNotFound, kTooLarge, kCapacity, kTimeout,
// kIo (LOAD_FAILED), kUnavailable (BUSY, UNAVAILABLE), kInvalidArgument.
// (A client raises a model's UNAVAILABLE with its cause's code instead:
// ServeError below.)
ErrorCode CoreCodeOf(ServeCode code);

// An error reply of the daemon, or a failure of the client itself.
class ServeError : public Error {
 public:
  ServeError(ServeCode code, const std::string& message)
      : ServeError(code, CoreCodeOf(code), message) {}
  // With a core code of its own: a LOAD_FAILED reply says whether the
  // files could not be read (kIo) or were not valid (kInvalidData), and so
  // does the UNAVAILABLE of a model whose files fail the daemon's checks
  // (then it is a ServeError, not a DaemonUnavailableError).
  ServeError(ServeCode code, ErrorCode core_code, const std::string& message)
      : Error(core_code, message), serve_code_(code) {}
  ServeCode serve_code() const { return serve_code_; }

 private:
  ServeCode serve_code_;
};

// The daemon cannot be reached: no socket at the path, nobody listening,
// the connection was lost and could not be made again before the deadline,
// or the daemon is shutting down. Code kUnavailable.
class DaemonUnavailableError : public ServeError {
 public:
  explicit DaemonUnavailableError(const std::string& message)
      : ServeError(ServeCode::kUnavailable, message) {}
};

}  // namespace modelcache::serve

#endif  // MODELCACHE_SERVE_ERRORS_H_
