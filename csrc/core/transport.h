// The transport interface: ordered, bounded streams of frames between two ranks.
//
// A Channel connects this rank with one peer in both directions. Each direction is a ring
// of `pipeline_depth` slots of `chunk_bytes()` payload. The sender fills the slot that
// begin_send() returns and publishes it with end_send(); the receiver reads the payload in
// place between begin_recv() and end_recv(). Algorithms therefore reduce straight out of
// the received slot and write straight into the outgoing one: no extra staging copy.
//
// Ordering: frames are delivered in the order they were sent. The payload of a frame is
// visible to the receiver when begin_recv() returns (release/acquire on shared memory,
// the socket's ordering on TCP). A slot is reused only after the receiver's end_recv().
//
// Failure: every wait is bounded by the caller's deadline; a dead or aborting peer turns
// any wait on it into an Error naming the peer within kLivenessSlice or so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config.h"
#include "deadline.h"
#include "store.h"

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
  uint8_t algorithm = 0;  // Algorithm chosen for it: ranks that chose differently fail fast
  int32_t root = 0;       // root rank or p2p tag
  uint8_t compression = 0;       // Compression on the wire
  uint8_t compression_block = 0; // log2 of its block
  uint8_t determinism = 0;       // Determinism: ranks in different modes would fold differently
  uint8_t reserved[5] = {};
  bool operator==(const OpStamp& o) const {
    return seq == o.seq && count == o.count && collective == o.collective && dtype == o.dtype &&
           reduce == o.reduce && algorithm == o.algorithm && root == o.root && compression == o.compression &&
           compression_block == o.compression_block && determinism == o.determinism;
  }
};
static_assert(sizeof(OpStamp) == 32, "OpStamp is a wire format");

// "allreduce #12 (float32, sum, 1000 elements)"; implemented with the collective table.
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
};

// Throws a Mismatch error unless `got` is a Data frame for exactly `expect`'s operation and
// size. Shared by every transport so that they report mismatches alike.
void check_frame(const FrameHeader& got, const FrameHeader& expect, const PeerInfo& peer);

class Channel {
 public:
  virtual ~Channel() = default;
  virtual int peer() const = 0;
  virtual size_t chunk_bytes() const = 0;
  // The next free outbound slot (chunk_bytes() writable bytes).
  virtual void* begin_send(const Deadline& deadline) = 0;
  // Publishes the slot from begin_send(); `header.bytes` payload bytes were written.
  virtual void end_send(const FrameHeader& header) = 0;
  // The payload of the next inbound frame, after check_frame(got, expect).
  virtual const void* begin_recv(const FrameHeader& expect, const Deadline& deadline) = 0;
  // Returns the slot from begin_recv() to the sender.
  virtual void end_recv() = 0;
  // The header of the next inbound frame if it has arrived, without consuming it; never
  // waits. Throws as a waiting begin_recv() would once no frame can arrive any more (the
  // transport or the peer aborted, the connection failed, the peer exited). For a receive
  // from any source, which looks at every channel in turn.
  virtual std::optional<FrameHeader> peek_recv() = 0;
  // The host memory that holds this channel's slot payloads, for a device to page-lock so
  // that its copies to and from the slots are direct DMA (see make_staged_channel); each
  // range starts a page and shares no page with other data; it lives as long as the channel. Empty: nothing to offer.
  struct Memory {
    void* data;
    size_t bytes;
  };
  virtual std::vector<Memory> slot_memory() const { return {}; }
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual Channel* channel(int peer) = 0;  // nullptr for a peer this transport does not serve
  // Fails every wait on this transport, here and (best effort) at the peers, with `reason`.
  // Safe to call from any thread, more than once.
  virtual void abort(const std::string& reason) = 0;
};

// Device memory for the slot payloads of a shared-memory transport (CUDA IPC): each rank
// allocates the payloads of its outbound rings and publishes a handle; peers map it once,
// for the transport's lifetime. Headers and counters stay in host shared memory.
// Visibility: a payload written by a completed device operation (DeviceOps contract) is
// visible to every later operation of a process that mapped it, before the tail store
// that publishes it; the receiver's reads are likewise complete before its head store.
// Lifetime: a transport frees its payloads only once its peers have consumed every frame
// it sent (or failed), so a rank that leaves first never pulls its last frames away.
class SlotArena {
 public:
  virtual ~SlotArena() = default;
  virtual const char* kind() const = 0;                  // the transport's name: "cuda-ipc"
  virtual std::string allocate(size_t bytes) = 0;        // this rank's payloads; the handle
  virtual char* base() = 0;                              // of this rank's payloads
  virtual char* map(const std::string& handle, int peer) = 0;  // a peer's payloads
};

struct TransportSetup {
  Store* store = nullptr;
  std::string key_prefix;          // private to this group instance
  int rank = 0;
  int size = 1;
  std::vector<int> peers;          // the ranks this transport must connect to
  std::vector<PeerInfo> ranks;     // every rank of the group, indexed by rank
  std::string secret;              // per-group secret, proves membership on connect
  const Config* config = nullptr;
  size_t chunk_bytes = 0;          // shm payload bytes per slot; 0: PYCOMM_SHM_CHUNK_BYTES
  SpinPolicy spin;
  Deadline deadline;               // for connection set-up
};

// `payloads`: slot payloads in device memory (see SlotArena); null: in the shared segment.
std::unique_ptr<Transport> make_shm_transport(const TransportSetup& setup,
                                              std::unique_ptr<SlotArena> payloads = nullptr);
std::unique_ptr<Transport> make_tcp_transport(const TransportSetup& setup);

class DeviceOps;
// A channel over `host` (a TCP channel, say) for payloads in device memory: each frame is
// copied between a device staging slot and the host slot by `ops`, which page-locks the
// host channel's slot memory for as long as this channel lives. The network transfer of
// one frame overlaps the device work of the next. `host` and `ops` must outlive it.
std::unique_ptr<Channel> make_staged_channel(Channel& host, const DeviceOps& ops);

}  // namespace pycomm
