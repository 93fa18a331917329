#include "proc_maps.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>

namespace modelcache::serve::detail {
namespace {

// Reads a hexadecimal or decimal number at the start of `text` and drops it
// and the single separator after it (when given).
bool Take(std::string_view* text, int base, uint64_t* value, char separator) {
  const char* begin = text->data();
  const char* end = begin + text->size();
  const auto [ptr, ec] = std::from_chars(begin, end, *value, base);
  if (ec != std::errc() || ptr == begin) return false;
  text->remove_prefix(static_cast<size_t>(ptr - begin));
  if (separator != 0) {
    if (text->empty() || text->front() != separator) return false;
    text->remove_prefix(1);
  }
  return true;
}

void SkipSpaces(std::string_view* text) {
  while (!text->empty() && text->front() == ' ') text->remove_prefix(1);
}

bool SkipField(std::string_view* text) {
  const size_t space = text->find(' ');
  if (space == std::string_view::npos || space == 0) return false;
  text->remove_prefix(space);
  SkipSpaces(text);
  return true;
}

}  // namespace

std::optional<MemfdMapping> ParseMapsLine(std::string_view line,
                                          std::string_view prefix, pid_t pid) {
  MemfdMapping m;
  m.pid = pid;
  uint64_t major = 0;
  uint64_t minor = 0;
  if (!Take(&line, 16, &m.start, '-') || !Take(&line, 16, &m.end, ' ') ||
      m.end < m.start || !SkipField(&line) /* perms */ ||
      !Take(&line, 16, &m.offset, ' ')) {
    return std::nullopt;
  }
  SkipSpaces(&line);
  if (!Take(&line, 16, &major, ':') || !Take(&line, 16, &minor, ' ')) {
    return std::nullopt;
  }
  SkipSpaces(&line);
  if (!Take(&line, 10, &m.inode, 0)) return std::nullopt;
  SkipSpaces(&line);
  constexpr std::string_view kMemfd = "/memfd:";
  if (line.substr(0, kMemfd.size()) != kMemfd) return std::nullopt;
  line.remove_prefix(kMemfd.size());
  if (!line.empty() && line.back() == '\n') line.remove_suffix(1);
  constexpr std::string_view kDeleted = " (deleted)";
  if (line.size() >= kDeleted.size() &&
      line.substr(line.size() - kDeleted.size()) == kDeleted) {
    line.remove_suffix(kDeleted.size());
  }
  if (line.substr(0, prefix.size()) != prefix) return std::nullopt;
  if (major > UINT32_MAX || minor > UINT32_MAX) return std::nullopt;
  m.dev_major = static_cast<uint32_t>(major);
  m.dev_minor = static_cast<uint32_t>(minor);
  m.name = std::string(line);
  if (m.offset > UINT64_MAX - (m.end - m.start)) return std::nullopt;
  return m;
}

std::vector<MemfdMapping> ScanMemfdMappings(std::string_view prefix,
                                            pid_t exclude_pid,
                                            int* unreadable) {
  std::vector<MemfdMapping> found;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return found;
  std::string text;
  char buffer[1 << 16];
  while (const dirent* entry = ::readdir(proc)) {
    uint64_t pid = 0;
    const std::string_view name(entry->d_name);
    const auto [ptr, ec] =
        std::from_chars(name.data(), name.data() + name.size(), pid);
    if (ec != std::errc() || ptr != name.data() + name.size() || pid == 0 ||
        static_cast<pid_t>(pid) == exclude_pid) {
      continue;
    }
    const std::string path = "/proc/" + std::string(name) + "/maps";
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == EACCES && unreadable != nullptr) ++*unreadable;
      continue;
    }
    text.clear();
    bool failed = false;
    for (;;) {
      const ssize_t n = ::read(fd, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        failed = true;
        if (errno == EACCES && unreadable != nullptr) ++*unreadable;
        break;
      }
      if (n == 0) break;
      text.append(buffer, static_cast<size_t>(n));
    }
    ::close(fd);
    if (failed) continue;
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      const std::string_view line(text.data() + start, end - start);
      // Cheap filter first: most lines are not memfds.
      if (line.find("/memfd:") != std::string_view::npos) {
        if (auto m = ParseMapsLine(line, prefix, static_cast<pid_t>(pid))) {
          found.push_back(std::move(*m));
        }
      }
      start = end + 1;
    }
  }
  ::closedir(proc);
  return found;
}

bool ProcessMemfds(pid_t pid, std::string_view prefix,
                   std::vector<std::pair<uint64_t, uint64_t>>* found) {
  const std::string base = "/proc/" + std::to_string(pid);
  std::ifstream maps(base + "/maps");
  if (!maps) return false;
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("/memfd:") == std::string::npos) continue;
    if (auto m = ParseMapsLine(line, prefix, pid)) {
      found->push_back(
          {static_cast<uint64_t>(makedev(m->dev_major, m->dev_minor)),
           m->inode});
    }
  }
  if (maps.bad()) return false;
  DIR* fds = ::opendir((base + "/fd").c_str());
  if (fds == nullptr) return false;
  const std::string wanted = "/memfd:" + std::string(prefix);
  char target[512];
  while (const dirent* entry = ::readdir(fds)) {
    if (entry->d_name[0] == '.') continue;
    const std::string link = base + "/fd/" + entry->d_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    if (std::string_view(target, static_cast<size_t>(n))
            .substr(0, wanted.size()) != wanted) {
      continue;
    }
    struct stat st;
    if (::stat(link.c_str(), &st) == 0) {
      found->push_back(
          {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)});
    }
  }
  ::closedir(fds);
  return true;
}

}  // namespace modelcache::serve::detail
