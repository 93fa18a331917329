// Text for one-line messages: an errno value's text, and untrusted text
// (names, paths, keys from files, users and peers) made fit to quote.
//
// Every layer builds messages from both, so the helpers live here, once: a
// message must neither call the thread-unsafe strerror() nor let a newline,
// a terminal escape or invalid UTF-8 from its input through.
#ifndef MODELCACHE_BASE_TEXT_H_
#define MODELCACHE_BASE_TEXT_H_

#include <cstddef>
#include <string>
#include <string_view>

namespace modelcache::base {

// strerror(error_number), thread-safely. Capture errno first (`const int e =
// errno;`): building the rest of a message may change it.
std::string ErrnoText(int error_number);

// `text` (a tensor name, a path, a key) made fit for one line of a message or
// a listing: control characters (C0, DEL, C1, U+2028, U+2029) and bytes that
// are not part of valid UTF-8 escaped as \xNN (\n, \t and \r by name), valid
// UTF-8 kept; cut at a character boundary to about `max_bytes`, with "..."
// appended, when longer. The result is valid UTF-8.
std::string Printable(std::string_view text, size_t max_bytes = 120);

// Printable(text, max_bytes) in single quotes, for names in messages.
std::string Quoted(std::string_view text, size_t max_bytes = 120);

}  // namespace modelcache::base

#endif  // MODELCACHE_BASE_TEXT_H_
