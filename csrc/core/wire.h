// What travels in front of every payload: the stamp of the operation a frame belongs to
// and the frame header, both wire formats, with the check every transport applies to
// what it receives, and the description of a rank that errors name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/types.h"

namespace pycomm {

// Identifies the operation a frame belongs to. Both ends compute it from their own call,
// so a mismatch between ranks (count, dtype, op, order of collectives) is detected on the
// first frame instead of hanging or corrupting data.
struct OpStamp {
  uint64_t seq = 0;       // collectives: the group's collective count; p2p: per-peer count
  uint64_t count = 0;     // elements of the whole operation
  uint8_t collective = 0; // Collective
  uint8_t dtype = 0;      // DataType
  uint8_t reduce = 0;     // ReduceKind
  uint8_t variant = 0;    // Variant planned for it: ranks that planned a collective differently
                          // fail fast; p2p: the sender's own, not matched (algorithms/p2p.h)
  int32_t root = 0;       // root rank or p2p tag
  uint8_t compression = 0;       // Compression on the wire
  uint8_t compression_block = 0; // log2 of its block
  uint8_t determinism = 0;       // Determinism: ranks in different modes would fold differently
  // 1: the exchange of result hashes that verifies operation `collective` #seq
  // (PYCOMM_VERIFY), an all-gather of `count` int64 per rank by `variant`; 0: the operation.
  uint8_t verification = 0;
  // Under a codec, the layout of its encoded pieces (numerics.h kCodeLayout), else 0:
  // ranks built with different layouts fail on the first frame instead of misreading it.
  uint8_t code_layout = 0;
  uint8_t reserved[3] = {};
  // compression = codec; under a codec, compression_block = log2(block) (block a power of
  // two) and code_layout = numerics.h kCodeLayout.
  void set_codec(Compression codec, size_t block);
  bool operator==(const OpStamp& o) const {
    return seq == o.seq && count == o.count && collective == o.collective && dtype == o.dtype && reduce == o.reduce &&
           variant == o.variant && root == o.root && compression == o.compression &&
           compression_block == o.compression_block && determinism == o.determinism && verification == o.verification &&
           code_layout == o.code_layout;
  }
};
static_assert(sizeof(OpStamp) == 32, "OpStamp is a wire format");

// "allreduce #12 (float32, sum, 1000 elements)", "allreduce #12 verification (hashes,
// direct)"; implemented with the collective table.
std::string describe(const OpStamp& op);

enum class FrameKind : uint16_t { Data = 1, Abort = 2 };
constexpr uint32_t kFrameMagic = 0x70634d46;  // "pcMF"

// Precedes every payload. Every field is validated before the payload is used.
struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t kind = static_cast<uint16_t>(FrameKind::Data);
  uint16_t reserved = 0;
  uint32_t bytes = 0;  // payload bytes, <= chunk_bytes(); for Abort, the reason's length
  uint32_t reserved2 = 0;
  OpStamp op;
};
static_assert(sizeof(FrameHeader) == 48, "FrameHeader is a wire format");

struct PeerInfo {
  int rank = -1;
  int pid = 0;
  int node = 0;           // index of the node (host, or PYCOMM_RANKS_PER_NODE group)
  std::string hostname;
  std::string host_key;   // equal only for processes that can share memory
  std::string describe() const;  // "rank 2 (pid 1234 on host-a)"
  // Whether the two processes can share memory, and each can watch the other's pid.
  bool shares_host_with(const PeerInfo& other) const { return host_key == other.host_key; }
};

// Throws a Mismatch error unless `got` is a Data frame for exactly `expect`'s operation and
// size. Shared by every transport so that they report mismatches alike.
void check_frame(const FrameHeader& got, const FrameHeader& expect, const PeerInfo& peer);
// Throws a Mismatch error ("malformed frame") unless `got` is a Data frame whose stamp
// describe() can print: what may be trusted of a frame before it is matched.
void check_well_formed(const FrameHeader& got, const PeerInfo& peer);
// Throws the Mismatch error of `peer` being in operation `theirs` where this rank is in
// `mine`.
[[noreturn]] void fail_mismatch(const OpStamp& theirs, const OpStamp& mine, const PeerInfo& peer);

}  // namespace pycomm
