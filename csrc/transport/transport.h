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
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/deadline.h"
#include "core/doorbell.h"
#include "core/store.h"
#include "core/wire.h"

namespace pycomm {

class Channel {
 public:
  virtual ~Channel() = default;
  virtual const PeerInfo& peer_info() const = 0;
  int peer() const { return peer_info().rank; }
  virtual size_t chunk_bytes() const = 0;
  // The next free outbound slot (chunk_bytes() writable bytes).
  virtual void* begin_send(const Deadline& deadline) = 0;
  // Publishes the slot from begin_send(); `header.bytes` payload bytes were written.
  virtual void end_send(const FrameHeader& header) = 0;
  // One frame of `header.bytes` bytes of host memory at `data`, which may be reused on
  // return: what begin_send(), a copy into the slot and end_send() do (this default). A
  // transport may hand the bytes on from `data` without the copy (TCP: what the socket
  // takes at once).
  virtual void send_host(const FrameHeader& header, const void* data, const Deadline& deadline) {
    void* slot = begin_send(deadline);
    if (header.bytes) std::memcpy(slot, data, header.bytes);  // an empty frame's data may be null
    end_send(header);
  }
  // The payload of the next inbound frame, whatever operation it belongs to, its header
  // in `got` as it arrived: the caller checks it (as check_frame does) before it trusts
  // the payload.
  virtual const void* begin_recv_next(FrameHeader& got, const Deadline& deadline) = 0;
  // The payload of the next inbound frame, after check_frame(got, expect).
  const void* begin_recv(const FrameHeader& expect, const Deadline& deadline) {
    FrameHeader got;
    const void* payload = begin_recv_next(got, deadline);
    check_frame(got, expect, peer_info());
    return payload;
  }
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
  // The doorbell this rank's peers ring when they publish a frame to it through this
  // transport (see doorbell.h), where the transport hosts one (in its shared memory);
  // null: it rings TransportSetup::doorbell instead.
  virtual DoorbellWord* doorbell() { return nullptr; }
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
  // How long the destructor waits for the frames of completed sends to reach the peers
  // (a group's: its timeout).
  std::chrono::milliseconds linger{5000};
  Doorbell doorbell;               // rung for every frame that arrives (transports that host none)
};

// This rank's segment of a shared-memory transport with `setup` (its outbound rings, in
// host memory), made ahead of the transport so that a group can first agree on what fits:
// its pages are allocated here, so a /dev/shm too small for it is known now, never as a
// SIGBUS at first touch. Null where it does not fit, with `shortage` saying so ("/dev/shm
// has 3.2 MiB free, rank 5 needed 15.0 MiB"). Unlinked when destroyed unless a transport
// took it.
class ShmSegment {
 public:
  virtual ~ShmSegment() = default;
};
std::unique_ptr<ShmSegment> reserve_shm_segment(const TransportSetup& setup, std::string& shortage);
// The bytes of /dev/shm that reserve_shm_segment(setup) takes.
size_t shm_segment_bytes(const TransportSetup& setup);

// `segment`: from reserve_shm_segment(setup); null: made here, an InvalidArgument error
// where it does not fit. `payloads`: slot payloads in device memory (see SlotArena; then
// `segment` must be null); null: in the shared segment.
std::unique_ptr<Transport> make_shm_transport(const TransportSetup& setup,
                                              std::unique_ptr<ShmSegment> segment = nullptr,
                                              std::unique_ptr<SlotArena> payloads = nullptr);
std::unique_ptr<Transport> make_tcp_transport(const TransportSetup& setup);

class DeviceOps;
// A channel over `host` (a TCP channel, say) for payloads in device memory: each frame is
// copied between a device staging slot and the host slot by `ops`, which page-locks the
// host channel's slot memory for as long as this channel lives. The network transfer of
// one frame overlaps the device work of the next. `host` and `ops` must outlive it.
std::unique_ptr<Channel> make_staged_channel(Channel& host, const DeviceOps& ops);

}  // namespace pycomm
