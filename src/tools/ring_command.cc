// `modelcache ring`: the parsing of --nodes, --hash-type and --models, and the
// owner and moved-set listings (see ring_command.h).
//
// Every message quotes user input through base::Printable, so that it
// stays one line whatever bytes the input holds.
#include "ring_command.h"

#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "modelcache/base/csv.h"
#include "modelcache/base/errors.h"
#include "modelcache/base/text.h"

namespace modelcache::tools {

namespace {

using base::Printable;
using csv::Trim;
using replay::ConsistentHashRing;
using replay::MapBasedHash;
using replay::RingServer;

[[noreturn]] void InvalidFlag(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

std::vector<std::string_view> Split(std::string_view text, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(sep, start);
    parts.push_back(text.substr(start, end - start));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= '0' && c <= '9') || c == '.' || c == '-' || c == '_';
}

// A whole decimal number (digits only), or false; `*overflow` says whether
// the digits were too many for int64.
bool ParseWhole(std::string_view text, int64_t* out, bool* overflow) {
  *overflow = false;
  if (text.empty()) return false;
  for (const char c : text) {
    if (c < '0' || c > '9') return false;
  }
  const auto [end, ec] =
      std::from_chars(text.data(), text.data() + text.size(), *out);
  if (ec == std::errc::result_out_of_range) {
    *overflow = true;
    return false;
  }
  return ec == std::errc() && end == text.data() + text.size();
}

int64_t ParseNodeNumber(std::string_view entry, std::string_view what,
                        std::string_view text) {
  int64_t value = 0;
  bool overflow = false;
  if (!ParseWhole(text, &value, &overflow)) {
    InvalidFlag("--nodes: the " + std::string(what) + " '" + Printable(text) +
                "' of '" + Printable(entry) + "' " +
                (overflow ? "is out of range" : "is not a whole number"));
  }
  return value;
}

// One CSV line's fields (the trace readers' rules).
std::vector<std::string> SplitCsv(std::string_view line) {
  std::vector<std::string> fields;
  csv::SplitCsv(line, &fields);
  return fields;
}

[[noreturn]] void BadFile(const std::string& path, size_t line,
                          const std::string& problem) {
  throw Error(ErrorCode::kInvalidData,
              Printable(path) + ":" + std::to_string(line) + ": " + problem);
}

// The bytes HAProxy can see raw in a path segment of the request line.
void CheckModelId(const std::string& path, size_t line, std::string_view id) {
  if (id.empty()) BadFile(path, line, "empty model id");
  for (const char ch : id) {
    const auto c = static_cast<unsigned char>(ch);
    if (c <= 0x20 || c >= 0x7f || c == '/' || c == '?' || c == '#') {
      BadFile(path, line,
              "model id '" + Printable(id) +
                  "' cannot stand as it is in /v1/models/{id}/infer (it has "
                  "a space, a control or non-ASCII byte, '/', '?' or '#'); "
                  "give it percent-encoded, as clients send it and HAProxy "
                  "hashes it");
    }
  }
}

// A CSV field: quoted when it holds a comma or a quote.
std::string CsvField(std::string_view text) {
  if (text.find_first_of(",\"") == std::string_view::npos) {
    return std::string(text);
  }
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::vector<RingServer> ParseNodeList(std::string_view text) {
  if (Trim(text).empty()) InvalidFlag("--nodes: empty list");
  std::vector<RingServer> servers;
  for (const std::string_view raw : Split(text, ',')) {
    const std::string_view entry = Trim(raw);
    if (entry.empty()) {
      InvalidFlag("--nodes: empty entry in '" + Printable(text) +
                  "' (entries are name:id:weight, separated by commas)");
    }
    const std::vector<std::string_view> parts = Split(entry, ':');
    if (parts.size() != 3) {
      InvalidFlag("--nodes: '" + Printable(entry) + "' is not name:id:weight");
    }
    const std::string_view name = parts[0];
    if (name.empty()) {
      InvalidFlag("--nodes: '" + Printable(entry) + "' has an empty name");
    }
    for (const char c : name) {
      if (!IsNameChar(c)) {
        InvalidFlag("--nodes: the name '" + Printable(name) +
                    "' may hold only letters, digits, '.', '-' and '_'");
      }
    }
    RingServer server;
    server.name = std::string(name);
    server.id = ParseNodeNumber(entry, "id", parts[1]);
    const int64_t weight = ParseNodeNumber(entry, "weight", parts[2]);
    if (weight < replay::kMinRingWeight || weight > replay::kMaxRingWeight) {
      InvalidFlag("--nodes: '" + Printable(entry) + "' has weight " +
                  std::to_string(weight) + ", outside HAProxy's " +
                  std::to_string(replay::kMinRingWeight) + "-" +
                  std::to_string(replay::kMaxRingWeight));
    }
    server.weight = static_cast<int>(weight);
    servers.push_back(std::move(server));
  }
  try {
    replay::ValidateRingServers(servers);
  } catch (const Error& e) {
    InvalidFlag(std::string("--nodes: ") + e.what());
  }
  return servers;
}

HashType ParseHashType(std::string_view text) {
  std::istringstream in{std::string(text)};
  std::vector<std::string> owned;
  for (std::string word; in >> word;) owned.push_back(word);
  const auto fail = [&](const std::string& why) {
    InvalidFlag("--hash-type: '" + Printable(text) + "': " + why);
  };
  if (owned.empty()) fail("empty");
  HashType type;
  if (owned[0] == "consistent") {
    type.consistent = true;
  } else if (owned[0] == "map-based") {
    type.consistent = false;
  } else {
    fail("the type is 'consistent' or 'map-based'");
  }
  if (owned.size() == 1) {
    // HAProxy's defaults: sdbm, with avalanche only for consistent.
    type.avalanche = type.consistent;
    return type;
  }
  if (owned[1] != "sdbm") {
    fail("only the sdbm function is modelled (HAProxy's default)");
  }
  type.avalanche = false;
  if (owned.size() >= 3) {
    if (owned[2] != "avalanche" || owned.size() > 3) {
      fail("after the function only 'avalanche' may follow");
    }
    type.avalanche = true;
  }
  return type;
}

std::vector<std::string> ReadModelIds(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw Error(ErrorCode::kIo,
                Printable(path) + ": is a directory, not a file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(ErrorCode::kIo, Printable(path) + ": cannot open file");
  }
  std::vector<std::string> ids;
  std::unordered_set<std::string> seen;
  const auto add = [&](size_t line_no, std::string_view id) {
    CheckModelId(path, line_no, id);
    if (seen.emplace(id).second) ids.emplace_back(id);
  };
  std::string line;
  size_t line_no = 0;
  int model_col = -1;  // -1: not known yet; -2: one id per line
  while (std::getline(in, line)) {
    ++line_no;
    if (Trim(line).empty()) continue;
    if (model_col == -1) {
      if (line.find(',') == std::string::npos && Trim(line) != "model") {
        model_col = -2;  // no header: this line is an id
      } else {
        const std::vector<std::string> header = SplitCsv(line);
        for (size_t i = 0; i < header.size(); ++i) {
          if (Trim(header[i]) == "model") {
            model_col = static_cast<int>(i);
            break;
          }
        }
        if (model_col < 0) {
          BadFile(path, line_no,
                  "a CSV header must name a 'model' column (or give one "
                  "model id per line)");
        }
        continue;
      }
    }
    if (model_col == -2) {
      add(line_no, Trim(line));
      continue;
    }
    const std::vector<std::string> fields = SplitCsv(line);
    if (static_cast<int>(fields.size()) <= model_col) {
      BadFile(path, line_no,
              "expected at least " + std::to_string(model_col + 1) +
                  " fields, found " + std::to_string(fields.size()));
    }
    add(line_no, Trim(fields[static_cast<size_t>(model_col)]));
  }
  if (in.bad()) {
    throw Error(ErrorCode::kIo, Printable(path) + ": read failed");
  }
  if (ids.empty()) BadFile(path, line_no == 0 ? 1 : line_no, "no model ids");
  return ids;
}

int RunRing(const RingFlags& flags, std::ostream& out, std::ostream& err) {
  std::string listing;
  try {
    std::vector<RingServer> servers = ParseNodeList(flags.nodes);
    const HashType type = ParseHashType(flags.hash_type);
    std::vector<size_t> killed;
    for (const std::string& name : flags.kill) {
      size_t index = ConsistentHashRing::kNone;
      for (size_t i = 0; i < servers.size(); ++i) {
        if (servers[i].name == name) index = i;
      }
      if (index == ConsistentHashRing::kNone) {
        InvalidFlag("--kill: no node named '" + Printable(name) +
                    "' in --nodes");
      }
      killed.push_back(index);
    }
    std::unordered_set<size_t> distinct(killed.begin(), killed.end());
    if (!killed.empty() && distinct.size() == servers.size()) {
      InvalidFlag("--kill: every node would be down (HAProxy answers 503)");
    }
    const std::vector<std::string> models = ReadModelIds(flags.models);

    // Owners before and after the kill, by index.
    std::vector<size_t> before, after;
    if (type.consistent) {
      ConsistentHashRing ring(servers);
      for (const std::string& m : models) {
        before.push_back(
            ring.Owner(replay::HaproxySampleKey(m, type.avalanche)));
      }
      for (const size_t k : killed) ring.SetDown(k);
      for (const std::string& m : models) {
        after.push_back(
            ring.Owner(replay::HaproxySampleKey(m, type.avalanche)));
      }
    } else {
      MapBasedHash map(servers);
      for (const std::string& m : models) {
        before.push_back(
            map.Select(replay::HaproxySampleKey(m, type.avalanche)));
      }
      for (const size_t k : killed) map.SetDown(k);
      for (const std::string& m : models) {
        after.push_back(
            map.Select(replay::HaproxySampleKey(m, type.avalanche)));
      }
    }

    std::ostringstream text;
    if (flags.kill.empty()) {
      text << "model,node\n";
      for (size_t i = 0; i < models.size(); ++i) {
        text << CsvField(models[i]) << "," << servers[before[i]].name << "\n";
      }
    } else {
      text << "model,from,to\n";
      for (size_t i = 0; i < models.size(); ++i) {
        if (before[i] == after[i]) continue;
        text << CsvField(models[i]) << "," << servers[before[i]].name << ","
             << servers[after[i]].name << "\n";
      }
    }
    listing = text.str();
  } catch (const Error& e) {
    err << "error: " << e.what() << "\n";
    return 1;
  }
  out << listing;
  out.flush();
  return 0;
}

}  // namespace modelcache::tools
