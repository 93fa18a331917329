// The record's and the handover's formats: JSON objects, checked field by
// field (handover.h).
#include "handover.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "event_loop.h"
#include "modelcache/base/errors.h"
#include "modelcache/base/text.h"
#include "protocol.h"

namespace modelcache::serve::detail {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxCopies = 1 << 16;
constexpr size_t kMaxLeases = 1 << 20;
constexpr size_t kMaxReadBytes = size_t{16} << 20;

json IdJson(const MemfdId& id) { return json::array({id.dev, id.inode}); }

json CopyJson(const RecordedCopy& copy) {
  json files = json::array();
  for (const RecordedFile& f : copy.files) {
    files.push_back({{"name", f.name},
                     {"data_bytes", f.data_bytes},
                     {"header_bytes", f.header_bytes},
                     {"data", IdJson(f.data)},
                     {"data_size", f.data_size},
                     {"header", IdJson(f.header)},
                     {"header_hash", f.header_hash}});
  }
  return {{"model", copy.model}, {"files", std::move(files)}};
}

// Field readers: false (and `why` set) when missing or of the wrong type.
class Reader {
 public:
  explicit Reader(std::string* why) : why_(why) {}

  bool Unsigned(const json& o, const char* name, uint64_t* out) {
    const auto it = o.find(name);
    if (it == o.end() || !it->is_number_unsigned()) {
      return Fail(std::string("'") + name + "' is not an unsigned integer");
    }
    *out = it->get<uint64_t>();
    return true;
  }
  bool Signed(const json& o, const char* name, int64_t* out) {
    const auto it = o.find(name);
    if (it == o.end() || !it->is_number_integer()) {
      return Fail(std::string("'") + name + "' is not an integer");
    }
    *out = it->get<int64_t>();
    return true;
  }
  bool String(const json& o, const char* name, std::string* out) {
    const auto it = o.find(name);
    if (it == o.end() || !it->is_string()) {
      return Fail(std::string("'") + name + "' is not a string");
    }
    *out = it->get<std::string>();
    return true;
  }
  bool Bool(const json& o, const char* name, bool* out) {
    const auto it = o.find(name);
    if (it == o.end() || !it->is_boolean()) {
      return Fail(std::string("'") + name + "' is not a boolean");
    }
    *out = it->get<bool>();
    return true;
  }
  bool Id(const json& o, const char* name, MemfdId* out) {
    const auto it = o.find(name);
    if (it == o.end() || !it->is_array() || it->size() != 2 ||
        !(*it)[0].is_number_unsigned() || !(*it)[1].is_number_unsigned()) {
      return Fail(std::string("'") + name + "' is not [dev, inode]");
    }
    out->dev = (*it)[0].get<uint64_t>();
    out->inode = (*it)[1].get<uint64_t>();
    return true;
  }
  bool Array(const json& o, const char* name, size_t max, const json** out) {
    const auto it = o.find(name);
    if (it == o.end() || !it->is_array() || it->size() > max) {
      return Fail(std::string("'") + name + "' is not an array of at most " +
                  std::to_string(max));
    }
    *out = &*it;
    return true;
  }
  bool Copy(const json& o, RecordedCopy* out) {
    if (!o.is_object()) return Fail("a copy is not an object");
    const json* files = nullptr;
    if (!String(o, "model", &out->model) ||
        !Array(o, "files", protocol::kMaxFilesPerModel, &files)) {
      return false;
    }
    if (!protocol::IsValidModelId(out->model)) {
      return Fail("a copy's model id is not valid");
    }
    for (const json& f : *files) {
      if (!f.is_object()) return Fail("a file is not an object");
      RecordedFile file;
      if (!String(f, "name", &file.name) ||
          !Unsigned(f, "data_bytes", &file.data_bytes) ||
          !Unsigned(f, "header_bytes", &file.header_bytes) ||
          !Id(f, "data", &file.data) ||
          !Unsigned(f, "data_size", &file.data_size) ||
          !Id(f, "header", &file.header) ||
          !Unsigned(f, "header_hash", &file.header_hash)) {
        return false;
      }
      if (file.data_bytes > file.data_size) {
        return Fail("a file's data bytes exceed its memfd");
      }
      out->files.push_back(std::move(file));
    }
    return true;
  }
  bool Fail(std::string why) {
    if (why_->empty()) *why_ = std::move(why);
    return false;
  }

 private:
  std::string* why_;
};

// Parses `text` as one JSON object nesting at most `depth`; null on error.
std::optional<json> Object(std::string_view text, int depth, std::string* why) {
  if (text.size() > kMaxReadBytes) {
    *why = "larger than " + std::to_string(kMaxReadBytes) + " bytes";
    return std::nullopt;
  }
  if (!protocol::NestingAtMost(text, depth)) {
    *why = "nests too deeply";
    return std::nullopt;
  }
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    *why = "not a JSON object";
    return std::nullopt;
  }
  return doc;
}

}  // namespace

uint64_t HeaderHash(std::string_view bytes) { return Fnv1a(bytes); }

std::string FdStoreName(const MemfdId& first_header) {
  return "copy-" + std::to_string(first_header.dev) + "-" +
         std::to_string(first_header.inode);
}

std::string CatalogDigest(std::string_view catalog_text) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx",
                static_cast<unsigned long long>(HeaderHash(catalog_text)));
  return std::string(hex) + ":" + std::to_string(catalog_text.size());
}

std::string EncodeRecord(const Record& record) {
  json copies = json::array();
  for (const RecordedCopy& c : record.copies) copies.push_back(CopyJson(c));
  return json{{"version", kHandoverVersion},
              {"instance", record.instance},
              {"pid", record.pid},
              {"copies", std::move(copies)}}
      .dump();
}

std::string ParseRecord(std::string_view text, Record* out) {
  std::string why;
  const std::optional<json> doc = Object(text, 6, &why);
  if (!doc) return why;
  Reader r(&why);
  uint64_t version = 0;
  const json* copies = nullptr;
  if (!r.Unsigned(*doc, "version", &version)) return why;
  if (version != kHandoverVersion) {
    return "version " + std::to_string(version) + " (this daemon reads " +
           std::to_string(kHandoverVersion) + ")";
  }
  Record record;
  if (!r.String(*doc, "instance", &record.instance) ||
      !r.Signed(*doc, "pid", &record.pid) ||
      !r.Array(*doc, "copies", kMaxCopies, &copies)) {
    return why;
  }
  for (const json& c : *copies) {
    RecordedCopy copy;
    if (!r.Copy(c, &copy)) return why;
    record.copies.push_back(std::move(copy));
  }
  *out = std::move(record);
  return "";
}

std::string EncodeHandover(const Handover& h) {
  json copies = json::array();
  for (const RecordedCopy& c : h.copies) copies.push_back(CopyJson(c));
  json leases = json::array();
  for (const HandoverLease& l : h.leases) {
    leases.push_back({{"id", l.id},
                      {"copy", l.copy},
                      {"pid", l.pid},
                      {"uid", l.uid},
                      {"idle", l.idle}});
  }
  json pinned = json::array();
  for (const bool p : h.pinned) pinned.push_back(p);
  return json{{"version", h.version},        {"catalog", h.catalog},
              {"next_lease", h.next_lease},  {"listeners", h.listeners},
              {"copies", std::move(copies)}, {"loads", h.loads},
              {"pinned", std::move(pinned)}, {"leases", std::move(leases)}}
      .dump();
}

std::string ParseHandover(std::string_view text, Handover* out) {
  std::string why;
  const std::optional<json> doc = Object(text, 6, &why);
  if (!doc) return why;
  Reader r(&why);
  Handover h;
  if (!r.Unsigned(*doc, "version", &h.version)) return why;
  if (h.version != kHandoverVersion) {
    return "handover version " + std::to_string(h.version) +
           " (this daemon takes " + std::to_string(kHandoverVersion) + ")";
  }
  const json* listeners = nullptr;
  const json* copies = nullptr;
  const json* loads = nullptr;
  const json* pinned = nullptr;
  const json* leases = nullptr;
  if (!r.String(*doc, "catalog", &h.catalog) ||
      !r.Unsigned(*doc, "next_lease", &h.next_lease) ||
      !r.Array(*doc, "listeners", 16, &listeners) ||
      !r.Array(*doc, "copies", kMaxCopies, &copies) ||
      !r.Array(*doc, "loads", kMaxCopies, &loads) ||
      !r.Array(*doc, "pinned", kMaxCopies, &pinned) ||
      !r.Array(*doc, "leases", kMaxLeases, &leases)) {
    return why;
  }
  for (const json& l : *listeners) {
    if (!l.is_string()) return "a listener's name is not a string";
    h.listeners.push_back(l.get<std::string>());
  }
  for (const json& c : *copies) {
    RecordedCopy copy;
    if (!r.Copy(c, &copy)) return why;
    h.copies.push_back(std::move(copy));
  }
  if (loads->size() != h.copies.size() || pinned->size() != h.copies.size()) {
    return "'loads' and 'pinned' must have one entry per copy";
  }
  for (const json& l : *loads) {
    if (!l.is_number_unsigned()) return "a copy's loads is not an integer";
    h.loads.push_back(l.get<uint64_t>());
  }
  for (const json& p : *pinned) {
    if (!p.is_boolean()) return "a copy's pinned is not a boolean";
    h.pinned.push_back(p.get<bool>());
  }
  for (const json& l : *leases) {
    if (!l.is_object()) return "a lease is not an object";
    HandoverLease lease;
    uint64_t copy = 0;
    if (!r.Unsigned(l, "id", &lease.id) || !r.Unsigned(l, "copy", &copy) ||
        !r.Signed(l, "pid", &lease.pid) || !r.Unsigned(l, "uid", &lease.uid) ||
        !r.Bool(l, "idle", &lease.idle)) {
      return why;
    }
    if (copy >= h.copies.size()) return "a lease names a copy not handed over";
    lease.copy = static_cast<size_t>(copy);
    h.leases.push_back(lease);
  }
  *out = std::move(h);
  return "";
}

size_t HandoverFdCount(const Handover& h) {
  size_t n = h.listeners.size();
  for (const RecordedCopy& c : h.copies) n += 2 * c.files.size();
  return n;
}

std::string RecordPath(const std::string& socket_path) {
  return socket_path + ".state";
}

void WriteFileAtomically(const std::string& path, std::string_view text) {
  // A temporary of this process's own: an old daemon and its successor
  // (two processes) never share one, as the record's writers in one
  // process do not (record_write_mu_).
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  const int fd =
      ::open(temporary.c_str(),
             O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0640);
  if (fd < 0) {
    const int e = errno;
    throw Error(ErrorCode::kIo,
                "cannot write " + temporary + ": " + base::ErrnoText(e));
  }
  size_t done = 0;
  int error = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error = errno;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (error == 0 && (::fchmod(fd, 0640) != 0 || ::fsync(fd) != 0)) {
    error = errno;
  }
  ::close(fd);
  if (error == 0 && ::rename(temporary.c_str(), path.c_str()) != 0) {
    error = errno;
  }
  if (error != 0) {
    ::unlink(temporary.c_str());
    throw Error(ErrorCode::kIo,
                "cannot write " + path + ": " + base::ErrnoText(error));
  }
}

std::optional<std::string> ReadSmallFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) return std::nullopt;
    throw Error(ErrorCode::kIo,
                "cannot read " + path + ": " + base::ErrnoText(e));
  }
  std::string text;
  char buffer[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      throw Error(ErrorCode::kIo,
                  "cannot read " + path + ": " + base::ErrnoText(e));
    }
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > kMaxReadBytes) {
      ::close(fd);
      throw Error(ErrorCode::kIo, path + " is larger than 16 MiB");
    }
  }
  ::close(fd);
  return text;
}

}  // namespace modelcache::serve::detail
