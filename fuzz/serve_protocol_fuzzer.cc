// libFuzzer target for the parsers of `modelcache serve` that read bytes
// from outside: a client's request (the daemon's side), a reply (the
// client's side), a catalog, and a line of /proc/PID/maps. The first byte
// of the input picks the parser; the rest is its input.
//
// Each parser must return (an error or a value) without crashing, whatever
// the bytes. A request that parses must encode and parse back to the same
// request; a reply that parses must have a consistent shape.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "modelcache/serve/catalog.h"
#include "proc_maps.h"
#include "protocol.h"

namespace {

namespace p = modelcache::serve::protocol;

void Check(bool ok) {
  if (!ok) std::abort();
}

void Request(std::string_view bytes) {
  const p::ParsedRequest parsed = p::ParseRequest(bytes);
  if (!parsed.request) {
    Check(!parsed.error.empty());
    return;
  }
  const p::Request& r = *parsed.request;
  Check(r.id != 0 && parsed.id == r.id);
  std::string again;
  switch (r.op) {
    case p::Op::kHello:
      again = p::EncodeHello(r.id);
      break;
    case p::Op::kAcquire:
      Check(p::IsValidModelId(r.model));
      Check(r.timeout_ms <= p::kMaxTimeoutMs);
      again = p::EncodeAcquire(r.id, r.model, r.timeout_ms, r.fail_when_full);
      break;
    case p::Op::kRelease:
      again = p::EncodeRelease(r.id, r.lease);
      break;
    case p::Op::kPing:
      again = p::EncodePing(r.id);
      break;
  }
  const p::ParsedRequest round = p::ParseRequest(again);
  Check(round.request.has_value());
  Check(round.request->op == r.op && round.request->id == r.id &&
        round.request->model == r.model && round.request->lease == r.lease);
}

void Reply(std::string_view bytes) {
  const p::ParsedReply parsed = p::ParseReply(bytes);
  if (!parsed.reply) {
    Check(!parsed.error.empty());
    return;
  }
  Check(parsed.reply->files.size() <= p::kMaxFilesPerModel);
}

void Catalog(std::string_view bytes) {
  try {
    const modelcache::serve::Catalog c =
        modelcache::serve::Catalog::Parse(bytes, "fuzz.json");
    for (const auto& m : c.models()) {
      Check(modelcache::serve::IsValidModelId(m.id));
      Check(c.Find(m.id) == &m);
      Check(!m.files.empty() && m.files.size() <= p::kMaxFilesPerModel);
      for (const std::string& f : m.files) {
        Check(!f.empty() && f[0] != '/');
        // No component is "..": the catalog never names a file outside.
        const std::string padded = "/" + f + "/";
        Check(padded.find("/../") == std::string::npos);
      }
    }
  } catch (const modelcache::serve::CatalogError&) {
  }
}

void Maps(std::string_view bytes) {
  const auto m =
      modelcache::serve::detail::ParseMapsLine(bytes, "modelcache:", 1);
  if (m) {
    Check(m->end >= m->start);
    Check(m->name.rfind("modelcache:", 0) == 0);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1,
                               size - 1);
  switch (data[0] % 4) {
    case 0:
      Request(bytes);
      break;
    case 1:
      Reply(bytes);
      break;
    case 2:
      Catalog(bytes);
      break;
    default:
      Maps(bytes);
      break;
  }
  return 0;
}
