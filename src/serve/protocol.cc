// The lease protocol's parsers and encoders.
//
// A request is untrusted: it is read by a SAX handler that accepts exactly
// one flat JSON object of string and non-negative integer values, so the
// parser's memory is bounded by the message and nothing nests. A reply comes
// from the daemon, but a client must not crash on a bad one either: it is
// checked for nesting depth before it is parsed into a tree (whose parser and
// destructor are iterative in nlohmann::json 3.10 and later anyway), then
// every field the client reads is type-checked. Fields of a reply the client
// does not know are ignored, so that a newer daemon may add some; fields of
// a request the daemon does not know are refused, so that a mistake in a
// client shows at once.
#include "protocol.h"

#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

#include "modelcache/base/text.h"

namespace modelcache::serve::protocol {
namespace {

using json = nlohmann::json;

// How much of an untrusted name a message quotes: enough to recognize it,
// little enough that an error reply stays small.
constexpr size_t kQuotedBytes = 64;

std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

// One value of a request's flat object.
struct Field {
  bool is_string = false;
  std::string text;
  uint64_t number = 0;
};

constexpr size_t kMaxFields = 8;

class RequestSax {
 public:
  std::map<std::string, Field>& fields() { return fields_; }
  const std::string& error() const { return error_; }

  bool null() { return Unexpected("null"); }
  bool boolean(bool) { return Unexpected("a boolean"); }
  bool number_integer(json::number_integer_t value) {
    if (value == 0) return number_unsigned(0);
    return Unexpected("a negative number");
  }
  bool number_unsigned(json::number_unsigned_t value) {
    if (state_ != State::kValue) return Unexpected("a number");
    fields_[key_].number = value;
    state_ = State::kKey;
    return true;
  }
  bool number_float(json::number_float_t, const std::string&) {
    return Unexpected("a number that is not an integer below 2^64");
  }
  bool string(std::string& value) {
    if (state_ != State::kValue) return Unexpected("a string");
    Field& field = fields_[key_];
    field.is_string = true;
    field.text = std::move(value);
    state_ = State::kKey;
    return true;
  }
  bool binary(json::binary_t&) { return Unexpected("binary data"); }
  bool start_object(std::size_t) {
    if (state_ != State::kStart) return Unexpected("an object");
    state_ = State::kKey;
    return true;
  }
  bool key(std::string& key) {
    if (fields_.count(key) != 0) {
      return Fail("duplicate field " + base::Quoted(key, kQuotedBytes));
    }
    if (fields_.size() == kMaxFields) {
      return Fail("more than " + std::to_string(kMaxFields) + " fields");
    }
    key_ = std::move(key);
    fields_[key_];
    state_ = State::kValue;
    return true;
  }
  bool end_object() {
    state_ = State::kDone;
    return true;
  }
  bool start_array(std::size_t) { return Unexpected("an array"); }
  bool end_array() { return Fail("unexpected end of array"); }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception&) {
    return Fail("not valid JSON (at byte " + std::to_string(position) + ")");
  }

 private:
  enum class State { kStart, kKey, kValue, kDone };

  bool Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }
  bool Unexpected(const std::string& what) {
    if (state_ == State::kStart) {
      return Fail("a request must be a JSON object, found " + what);
    }
    if (state_ == State::kValue) {
      return Fail("field " + base::Quoted(key_, kQuotedBytes) +
                  " must be a string or a non-negative integer, found " + what);
    }
    return Fail("unexpected " + what);
  }

  State state_ = State::kStart;
  std::string key_;
  std::map<std::string, Field> fields_;
  std::string error_;
};

struct OpSpec {
  Op op;
  const char* name;
  std::vector<const char*> fields;  // besides op and id
};

const std::vector<OpSpec>& Ops() {
  static const std::vector<OpSpec> ops = {
      {Op::kHello, "hello", {"version"}},
      {Op::kAcquire, "acquire", {"model", "timeout_ms", "when_full"}},
      {Op::kRelease, "release", {"lease"}},
      {Op::kPing, "ping", {}},
      {Op::kIdle, "idle", {"lease"}},
      {Op::kUse, "use", {"lease"}},
      {Op::kReclaim, "reclaim", {"lease", "model", "use"}},
      {Op::kTakeover, "takeover", {"handover", "catalog"}},
      {Op::kCommit, "commit", {}},
      {Op::kDelegate, "delegate", {}},
      {Op::kDrain, "drain", {}},
  };
  return ops;
}

}  // namespace

// Checks the nesting of a JSON text without parsing it: brackets outside
// strings. Returns false past `max_depth`.
bool NestingAtMost(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

bool IsValidModelId(std::string_view id) {
  if (id.empty() || id.size() > kMaxModelIdBytes) return false;
  for (size_t i = 0; i < id.size(); ++i) {
    const char c = id[i];
    const bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                       (c >= '0' && c <= '9');
    if (i == 0 && !alnum) return false;
    if (!alnum && c != '.' && c != '_' && c != '-') return false;
  }
  return id.find("..") == std::string_view::npos;
}

const char* OpName(Op op) {
  for (const OpSpec& spec : Ops()) {
    if (spec.op == op) return spec.name;
  }
  return "unknown";
}

ParsedRequest ParseRequest(std::string_view message) {
  ParsedRequest out;
  if (message.size() > kMaxMessageBytes) {
    out.error = "message of " + std::to_string(message.size()) +
                " bytes exceeds the limit of " +
                std::to_string(kMaxMessageBytes);
    return out;
  }
  // The lexer would take a NUL for the end of the input.
  if (std::memchr(message.data(), 0, message.size()) != nullptr) {
    out.error = "not valid JSON: a NUL byte";
    return out;
  }
  RequestSax sax;
  const bool parsed =
      json::sax_parse(message.data(), message.data() + message.size(), &sax,
                      json::input_format_t::json,
                      /*strict=*/true,
                      /*ignore_comments=*/false);
  auto& fields = sax.fields();
  // The id, if one was read, so that even a bad request is answered as
  // itself.
  if (auto it = fields.find("id");
      it != fields.end() && !it->second.is_string) {
    out.id = it->second.number;
  }
  if (!parsed) {
    out.error = sax.error().empty() ? "not valid JSON" : sax.error();
    return out;
  }
  const auto id = fields.find("id");
  if (id == fields.end()) {
    out.error = "missing field 'id'";
    return out;
  }
  if (id->second.is_string || id->second.number == 0) {
    out.id = 0;
    out.error = "field 'id' must be an integer from 1 to 2^64 - 1";
    return out;
  }
  const auto op = fields.find("op");
  if (op == fields.end()) {
    out.error = "missing field 'op'";
    return out;
  }
  if (!op->second.is_string) {
    out.error = "field 'op' must be a string";
    return out;
  }
  const OpSpec* spec = nullptr;
  for (const OpSpec& s : Ops()) {
    if (op->second.text == s.name) spec = &s;
  }
  if (spec == nullptr) {
    out.error = "unknown op " + base::Quoted(op->second.text, kQuotedBytes) +
                " (known: hello, acquire, release, ping, idle, use, reclaim, "
                "takeover, commit, delegate)";
    return out;
  }
  for (const auto& [name, value] : fields) {
    if (name == "op" || name == "id") continue;
    bool belongs = false;
    for (const char* f : spec->fields) belongs = belongs || name == f;
    if (!belongs) {
      bool known = false;
      for (const OpSpec& s : Ops()) {
        for (const char* f : s.fields) known = known || name == f;
      }
      out.error = known ? "field " + base::Quoted(name, kQuotedBytes) +
                              " does not belong to op '" + spec->name + "'"
                        : "unknown field " + base::Quoted(name, kQuotedBytes);
      return out;
    }
  }

  Request request;
  request.op = spec->op;
  request.id = id->second.number;
  const auto number = [&](const char* name, uint64_t* value,
                          bool required) -> bool {
    const auto it = fields.find(name);
    if (it == fields.end()) {
      if (required) out.error = std::string("missing field '") + name + "'";
      return !required;
    }
    if (it->second.is_string) {
      out.error =
          std::string("field '") + name + "' must be a non-negative integer";
      return false;
    }
    *value = it->second.number;
    return true;
  };
  const auto model_field = [&]() -> bool {
    const auto model = fields.find("model");
    if (model == fields.end()) {
      out.error = "missing field 'model'";
      return false;
    }
    if (!model->second.is_string) {
      out.error = "field 'model' must be a string";
      return false;
    }
    if (!IsValidModelId(model->second.text)) {
      out.error = "model id " + base::Quoted(model->second.text, kQuotedBytes) +
                  " is not valid: 1 to 128 characters of [A-Za-z0-9._-], "
                  "starting with a letter or digit, without '..'";
      return false;
    }
    request.model = model->second.text;
    return true;
  };
  switch (spec->op) {
    case Op::kHello:
      if (!number("version", &request.version, false)) return out;
      break;
    case Op::kAcquire: {
      if (!model_field()) return out;
      if (!number("timeout_ms", &request.timeout_ms, false)) return out;
      if (request.timeout_ms > kMaxTimeoutMs) {
        out.error = "timeout_ms " + std::to_string(request.timeout_ms) +
                    " exceeds " + std::to_string(kMaxTimeoutMs) + " (a day)";
        return out;
      }
      if (const auto it = fields.find("when_full"); it != fields.end()) {
        if (!it->second.is_string ||
            (it->second.text != "wait" && it->second.text != "fail")) {
          out.error = "field 'when_full' must be \"wait\" or \"fail\"";
          return out;
        }
        request.fail_when_full = it->second.text == "fail";
      }
      break;
    }
    case Op::kRelease:
    case Op::kIdle:
    case Op::kUse:
      if (!number("lease", &request.lease, true)) return out;
      break;
    case Op::kReclaim: {
      if (!number("lease", &request.lease, true) || !model_field()) return out;
      const auto use = fields.find("use");
      if (use == fields.end()) {
        out.error = "missing field 'use'";
        return out;
      }
      if (!use->second.is_string ||
          (use->second.text != "in_use" && use->second.text != "idle")) {
        out.error = "field 'use' must be \"in_use\" or \"idle\"";
        return out;
      }
      request.idle = use->second.text == "idle";
      break;
    }
    case Op::kTakeover: {
      if (!number("handover", &request.handover, true)) return out;
      const auto digest = fields.find("catalog");
      if (digest == fields.end()) {
        out.error = "missing field 'catalog'";
        return out;
      }
      if (!digest->second.is_string || digest->second.text.size() > 128) {
        out.error = "field 'catalog' must be a digest string";
        return out;
      }
      request.catalog = digest->second.text;
      break;
    }
    case Op::kPing:
    case Op::kCommit:
    case Op::kDelegate:
    case Op::kDrain:
      break;
  }
  out.id = request.id;
  out.request = std::move(request);
  return out;
}

ParsedReply ParseReply(std::string_view message) {
  ParsedReply out;
  const auto fail = [&](std::string why) {
    out.error = std::move(why);
    return out;
  };
  if (message.size() > kMaxMessageBytes) {
    return fail("reply of " + std::to_string(message.size()) +
                " bytes exceeds the limit");
  }
  if (!NestingAtMost(message, 4)) return fail("reply nests too deeply");
  const json doc = json::parse(message, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    return fail("reply is not a JSON object");
  }
  const auto unsigned_field = [&](const json& object, const char* name,
                                  uint64_t* value, bool required) -> bool {
    const auto it = object.find(name);
    if (it == object.end()) return !required;
    if (!it->is_number_unsigned()) return false;
    *value = it->get<uint64_t>();
    return true;
  };
  const auto string_field = [&](const json& object, const char* name,
                                std::string* value, bool required) -> bool {
    const auto it = object.find(name);
    if (it == object.end()) return !required;
    if (!it->is_string()) return false;
    *value = it->get<std::string>();
    return true;
  };

  Reply reply;
  if (!unsigned_field(doc, "id", &reply.id, true)) {
    return fail("reply has no integer 'id'");
  }
  const auto ok = doc.find("ok");
  if (ok == doc.end() || !ok->is_boolean()) {
    return fail("reply has no boolean 'ok'");
  }
  reply.ok = ok->get<bool>();
  if (!reply.ok) {
    const auto error = doc.find("error");
    if (error == doc.end() || !error->is_object()) {
      return fail("error reply has no 'error' object");
    }
    std::string code;
    if (!string_field(*error, "code", &code, true)) {
      return fail("error reply has no 'code' string");
    }
    const auto parsed = ParseServeCode(code);
    if (!parsed) {
      return fail("error reply has an unknown code " +
                  base::Quoted(code, kQuotedBytes));
    }
    reply.code = *parsed;
    if (!string_field(*error, "message", &reply.message, true) ||
        !string_field(*error, "cause", &reply.cause, false)) {
      return fail("error reply has a bad 'message' or 'cause'");
    }
    out.reply = std::move(reply);
    return out;
  }
  if (!unsigned_field(doc, "version", &reply.version, false) ||
      !string_field(doc, "server", &reply.server, false) ||
      !unsigned_field(doc, "lease", &reply.lease, false) ||
      !string_field(doc, "model", &reply.model, false) ||
      !string_field(doc, "load", &reply.load, false) ||
      !unsigned_field(doc, "recall", &reply.recall, false)) {
    return fail("reply has a field of the wrong type");
  }
  if (const auto retired = doc.find("retired"); retired != doc.end()) {
    if (!retired->is_boolean()) return fail("'retired' is not a boolean");
    reply.retired = retired->get<bool>();
  }
  if (const auto drain = doc.find("drain"); drain != doc.end()) {
    if (!drain->is_boolean()) return fail("'drain' is not a boolean");
    reply.drain = drain->get<bool>();
  }
  if (!reply.load.empty() && reply.load != "hit" && reply.load != "miss" &&
      reply.load != "joined") {
    return fail("'load' is " + base::Quoted(reply.load, kQuotedBytes) +
                ", not \"hit\", \"miss\" or \"joined\"");
  }
  if (const auto limits = doc.find("limits"); limits != doc.end()) {
    if (!limits->is_object()) return fail("'limits' is not an object");
    for (const auto& [name, value] : limits->items()) {
      if (!value.is_number_unsigned()) {
        return fail("limit " + base::Quoted(name, kQuotedBytes) +
                    " is not an integer");
      }
      reply.limits[name] = value.get<uint64_t>();
    }
  }
  if (const auto files = doc.find("files"); files != doc.end()) {
    if (!files->is_array() || files->size() > kMaxFilesPerModel) {
      return fail("'files' is not an array of at most " +
                  std::to_string(kMaxFilesPerModel) + " files");
    }
    for (const json& file : *files) {
      if (!file.is_object()) return fail("a file is not an object");
      FileReply f;
      if (!string_field(file, "name", &f.name, true) ||
          !unsigned_field(file, "data_bytes", &f.data_bytes, true) ||
          !unsigned_field(file, "header_bytes", &f.header_bytes, true)) {
        return fail("a file lacks its name, data_bytes or header_bytes");
      }
      reply.files.push_back(std::move(f));
    }
  }
  out.reply = std::move(reply);
  return out;
}

std::string EncodeHello(uint64_t id) {
  return "{\"op\":\"hello\",\"id\":" + std::to_string(id) +
         ",\"version\":" + std::to_string(kVersion) + "}";
}

std::string EncodeAcquire(uint64_t id, std::string_view model,
                          uint64_t timeout_ms, bool fail_when_full) {
  // By hand: this is on every acquire's path. The model's name is the
  // caller's and is escaped.
  return "{\"op\":\"acquire\",\"id\":" + std::to_string(id) +
         ",\"model\":" + Dump(json(std::string(model))) +
         ",\"timeout_ms\":" + std::to_string(timeout_ms) +
         (fail_when_full ? ",\"when_full\":\"fail\"}" : "}");
}

std::string EncodeDelegate(uint64_t id) {
  return "{\"op\":\"delegate\",\"id\":" + std::to_string(id) + "}";
}

std::string EncodeDrain(uint64_t id) {
  return "{\"op\":\"drain\",\"id\":" + std::to_string(id) + "}";
}

std::string EncodeRelease(uint64_t id, uint64_t lease) {
  return "{\"op\":\"release\",\"id\":" + std::to_string(id) +
         ",\"lease\":" + std::to_string(lease) + "}";
}

std::string EncodeIdle(uint64_t id, uint64_t lease) {
  return "{\"op\":\"idle\",\"id\":" + std::to_string(id) +
         ",\"lease\":" + std::to_string(lease) + "}";
}

std::string EncodeUse(uint64_t id, uint64_t lease) {
  return "{\"op\":\"use\",\"id\":" + std::to_string(id) +
         ",\"lease\":" + std::to_string(lease) + "}";
}

std::string EncodeReclaim(uint64_t id, uint64_t lease, std::string_view model,
                          bool idle) {
  return "{\"op\":\"reclaim\",\"id\":" + std::to_string(id) +
         ",\"lease\":" + std::to_string(lease) +
         ",\"model\":" + Dump(json(std::string(model))) + ",\"use\":\"" +
         (idle ? "idle" : "in_use") + "\"}";
}

std::string EncodeTakeover(uint64_t id, uint64_t handover,
                           std::string_view catalog_digest) {
  return Dump(json{{"op", "takeover"},
                   {"id", id},
                   {"handover", handover},
                   {"catalog", std::string(catalog_digest)}});
}

std::string EncodeCommit(uint64_t id) {
  return "{\"op\":\"commit\",\"id\":" + std::to_string(id) + "}";
}

std::string EncodeRecall(uint64_t lease, bool retired, bool drain) {
  return "{\"id\":0,\"ok\":true,\"recall\":" + std::to_string(lease) +
         (retired ? ",\"retired\":true" : "") +
         (drain ? ",\"drain\":true" : "") + "}";
}

std::string EncodePing(uint64_t id) {
  return "{\"op\":\"ping\",\"id\":" + std::to_string(id) + "}";
}

std::string EncodeOk(uint64_t id) {
  return "{\"id\":" + std::to_string(id) + ",\"ok\":true}";
}

std::string EncodeHelloReply(uint64_t id, std::string_view server,
                             const std::map<std::string, uint64_t>& limits) {
  json reply = {{"id", id},
                {"ok", true},
                {"version", kVersion},
                {"server", std::string(server)},
                {"limits", limits}};
  return Dump(reply);
}

std::string EncodeAcquireReply(uint64_t id, uint64_t lease,
                               std::string_view model, std::string_view load,
                               const std::vector<FileReply>& files) {
  // By hand: this is on every acquire's path. Names are escaped.
  std::string out = "{\"id\":" + std::to_string(id) +
                    ",\"ok\":true,\"lease\":" + std::to_string(lease) +
                    ",\"model\":" + Dump(json(std::string(model))) +
                    ",\"load\":" + Dump(json(std::string(load))) +
                    ",\"files\":[";
  for (size_t i = 0; i < files.size(); ++i) {
    if (i > 0) out += ',';
    out += "{\"name\":" + Dump(json(files[i].name)) +
           ",\"data_bytes\":" + std::to_string(files[i].data_bytes) +
           ",\"header_bytes\":" + std::to_string(files[i].header_bytes) + "}";
  }
  return out + "]}";
}

std::string EncodeError(uint64_t id, ServeCode code, std::string_view message,
                        std::string_view cause) {
  json error = {{"code", ServeCodeName(code)},
                {"message", std::string(message)}};
  if (!cause.empty()) error["cause"] = std::string(cause);
  return Dump(json{{"id", id}, {"ok", false}, {"error", std::move(error)}});
}

}  // namespace modelcache::serve::protocol
