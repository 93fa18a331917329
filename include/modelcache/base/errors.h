// modelcache::Error: the one root of every exception the library throws.
//
// Each failure the library detects is a modelcache::Error carrying an
// ErrorCode, so a caller can catch "anything from modelcache" in one clause
// and branch on the kind without parsing messages. A layer adds a subclass
// only where it has fields worth their keep (weights::WeightsError names the
// file, device::DeviceError the device and a finer code). User code's own
// exceptions (a loader's, an unloader's) pass through unchanged: every waiter
// of a failed load receives that same exception object.
#ifndef MODELCACHE_BASE_ERRORS_H_
#define MODELCACHE_BASE_ERRORS_H_

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
  // The key, model or alias is not known where it must be, e.g. Pin() of a
  // key that is not resident.
  kNotFound,
  // The arguments are wrong whatever the state: an alias naming itself, an
  // option out of range, a malformed byte size.
  kInvalidArgument,
  // The call is not valid in the current state of the calling thread or the
  // cache, e.g. a loader that acquires the key it is loading, which would
  // wait for itself forever.
  kFailedPrecondition,
  // The bytes of a file (safetensors, trace, registry) are not valid for
  // their format. The message names the file and, where there is one, the
  // line.
  kInvalidData,
  // The operating system or a device refused an I/O operation: open, read,
  // mmap, a copy to or from a device.
  kIo,
  // A resource the call needs cannot be used here: no GPU, no driver.
  kUnavailable,
};

// "too_large", "capacity", "timeout", "not_found", "invalid_argument",
// "failed_precondition", "invalid_data", "io", "unavailable".
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

#endif  // MODELCACHE_BASE_ERRORS_H_
