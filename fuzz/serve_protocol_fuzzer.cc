// libFuzzer target for the parsers of `modelcache serve` that read bytes
// from outside: a client's request (the daemon's side), a reply (the
// client's side), a catalog, a line of /proc/PID/maps, and a predecessor's
// state file (the record) and handover. The first byte of the input picks
// the parser; the rest is its input.
//
// Each parser must return (an error or a value) without crashing, whatever
// the bytes. A request, record or handover that parses must encode and
// parse back to the same value; a reply that parses must have a consistent
// shape.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "handover.h"
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
    case p::Op::kIdle:
      again = p::EncodeIdle(r.id, r.lease);
      break;
    case p::Op::kUse:
      again = p::EncodeUse(r.id, r.lease);
      break;
    case p::Op::kReclaim:
      Check(p::IsValidModelId(r.model));
      again = p::EncodeReclaim(r.id, r.lease, r.model, r.idle);
      break;
    case p::Op::kTakeover:
      again = p::EncodeTakeover(r.id, r.handover, r.catalog);
      break;
    case p::Op::kCommit:
      again = p::EncodeCommit(r.id);
      break;
    case p::Op::kDelegate:
      again = p::EncodeDelegate(r.id);
      break;
    case p::Op::kDrain:
      again = p::EncodeDrain(r.id);
      break;
  }
  const p::ParsedRequest round = p::ParseRequest(again);
  Check(round.request.has_value());
  const p::Request& back = *round.request;
  Check(back.op == r.op && back.id == r.id && back.model == r.model &&
        back.lease == r.lease && back.idle == r.idle &&
        back.handover == r.handover && back.catalog == r.catalog);
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

namespace d = modelcache::serve::detail;

bool SameFiles(const std::vector<d::RecordedCopy>& a,
               const std::vector<d::RecordedCopy>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].model != b[i].model || a[i].files.size() != b[i].files.size()) {
      return false;
    }
    for (size_t j = 0; j < a[i].files.size(); ++j) {
      const d::RecordedFile& x = a[i].files[j];
      const d::RecordedFile& y = b[i].files[j];
      if (x.name != y.name || x.data_bytes != y.data_bytes ||
          x.header_bytes != y.header_bytes || x.data.dev != y.data.dev ||
          x.data.inode != y.data.inode || x.data_size != y.data_size ||
          x.header.dev != y.header.dev || x.header.inode != y.header.inode ||
          x.header_hash != y.header_hash) {
        return false;
      }
    }
  }
  return true;
}

void Record(std::string_view bytes) {
  d::Record record;
  const std::string why = d::ParseRecord(bytes, &record);
  if (!why.empty()) return;
  d::Record back;
  Check(d::ParseRecord(d::EncodeRecord(record), &back).empty());
  Check(back.instance == record.instance && back.pid == record.pid &&
        SameFiles(back.copies, record.copies));
}

void Handover(std::string_view bytes) {
  d::Handover handover;
  const std::string why = d::ParseHandover(bytes, &handover);
  if (!why.empty()) return;
  // Every lease names a copy of the handover, and the per-copy lists are
  // as long as the copies.
  for (const d::HandoverLease& lease : handover.leases) {
    Check(lease.copy < handover.copies.size());
  }
  Check(handover.loads.size() == handover.copies.size());
  Check(handover.pinned.size() == handover.copies.size());
  d::Handover back;
  Check(d::ParseHandover(d::EncodeHandover(handover), &back).empty());
  Check(back.version == handover.version && back.catalog == handover.catalog &&
        back.next_lease == handover.next_lease &&
        back.listeners == handover.listeners &&
        SameFiles(back.copies, handover.copies) &&
        back.loads == handover.loads && back.pinned == handover.pinned &&
        back.leases.size() == handover.leases.size());
  Check(d::HandoverFdCount(back) == d::HandoverFdCount(handover));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1,
                               size - 1);
  switch (data[0] % 6) {
    case 0:
      Request(bytes);
      break;
    case 1:
      Reply(bytes);
      break;
    case 2:
      Catalog(bytes);
      break;
    case 3:
      Maps(bytes);
      break;
    case 4:
      Record(bytes);
      break;
    default:
      Handover(bytes);
      break;
  }
  return 0;
}
