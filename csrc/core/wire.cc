#include "core/wire.h"

#include <sstream>

#include "core/error.h"
#include "core/numerics.h"

namespace pycomm {

std::string PeerInfo::describe() const {
  std::ostringstream os;
  os << "rank " << rank << " (pid " << pid << " on " << hostname << ")";
  return os.str();
}

void OpStamp::set_codec(Compression codec, size_t block) {
  compression = static_cast<uint8_t>(codec);
  if (codec == Compression::None) return;
  while ((size_t{1} << compression_block) < block) ++compression_block;
  code_layout = kCodeLayout;
}

std::string describe(const OpStamp& op) {
  std::ostringstream os;
  const auto c = static_cast<Collective>(op.collective);
  if (op.verification) {
    os << name_of(c) << " #" << op.seq << " verification (hashes, " << name_of(static_cast<Variant>(op.variant)) << ")";
    return os.str();
  }
  os << name_of(c) << " #" << op.seq << " (" << name_of(static_cast<DataType>(op.dtype));
  if (reduces(c)) os << ", " << name_of(static_cast<ReduceKind>(op.reduce));
  os << ", " << op.count << " elements";
  if (selects_algorithm(c)) os << ", " << name_of(static_cast<Variant>(op.variant));
  if (op.compression)
    os << ", " << name_of(static_cast<Compression>(op.compression)) << "/" << (size_t{1} << op.compression_block);
  if (op.compression && op.code_layout != kCodeLayout) os << ", code layout " << unsigned{op.code_layout};
  if (has_root(c)) os << ", root " << op.root;
  if (c == Collective::Send || c == Collective::Recv) os << ", tag " << op.root;
  os << ")";
  return os.str();
}

// The first field of a received stamp that describe() cannot print, as "<field> <value>",
// or "": enums out of range (their name is "?") and blocks that do not fit a size_t.
static std::string field_out_of_range(const OpStamp& op) {
  const auto unknown = [](const char* name) { return std::string(name) == "?"; };
  const struct {
    const char* field;
    unsigned value;
    bool bad;
  } fields[] = {
      {"collective", op.collective, unknown(name_of(static_cast<Collective>(op.collective)))},
      {"dtype", op.dtype, unknown(name_of(static_cast<DataType>(op.dtype)))},
      {"reduce op", op.reduce, unknown(name_of(static_cast<ReduceKind>(op.reduce)))},
      {"variant", op.variant, unknown(name_of(static_cast<Variant>(op.variant)))},
      {"compression", op.compression, unknown(name_of(static_cast<Compression>(op.compression)))},
      {"compression block", op.compression_block, op.compression_block >= 64},
      {"determinism", op.determinism, unknown(name_of(static_cast<Determinism>(op.determinism)))},
      {"verification", op.verification, op.verification > 1},
  };
  for (const auto& f : fields)
    if (f.bad) return std::string(f.field) + " " + std::to_string(f.value);
  return "";
}

void check_well_formed(const FrameHeader& got, const PeerInfo& peer) {
  if (got.magic != kFrameMagic || got.kind != static_cast<uint16_t>(FrameKind::Data))
    fail(ErrorKind::Mismatch, "malformed frame from " + peer.describe());
  // `got` came off the wire: only a stamp whose fields are all in range is described.
  const std::string bad = field_out_of_range(got.op);
  if (!bad.empty()) fail(ErrorKind::Mismatch, "malformed frame from " + peer.describe() + ": " + bad);
}

void fail_mismatch(const OpStamp& theirs, const OpStamp& mine, const PeerInfo& peer) {
  fail(ErrorKind::Mismatch, peer.describe() + " is in " + describe(theirs) + " but this rank is in " + describe(mine) +
                                ": ranks called different collectives or arguments");
}

void check_frame(const FrameHeader& got, const FrameHeader& expect, const PeerInfo& peer) {
  if (got.magic != kFrameMagic || got.kind != static_cast<uint16_t>(FrameKind::Data))
    fail(ErrorKind::Mismatch, "malformed frame from " + peer.describe());
  if (!(got.op == expect.op)) {
    check_well_formed(got, peer);
    fail_mismatch(got.op, expect.op, peer);
  }
  if (got.bytes != expect.bytes)
    fail(ErrorKind::Mismatch, peer.describe() + " sent " + std::to_string(got.bytes) + " bytes where " +
                                  std::to_string(expect.bytes) + " were expected in " + describe(expect.op));
}

}  // namespace pycomm
