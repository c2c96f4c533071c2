// Shared-memory transport between processes of one host.
//
// Payloads live in the slots of the shared segment, or, with a SlotArena, in device
// memory that peers map (CUDA IPC); the control below is the same for both.
//
// Layout: every rank creates one segment holding its outbound rings, one per peer of its
// shared-memory clique; every peer maps every other peer's segment. A ring has
// `pipeline_depth` slots of [FrameHeader | payload] and two counters: `tail` (frames
// published, written only by the sender) and `head` (frames consumed, written only by the
// receiver). The receiver reads payloads in place from the sender's segment.
//
// Memory ordering: the sender writes a slot, then stores tail with release; the receiver
// loads tail with acquire before reading the slot. The receiver stores head with release
// after it is done with the slot; the sender loads head with acquire before reusing it.
//
// Waiting: spin for SpinPolicy::spin, then sleep on a futex on the counter, in slices of
// kLivenessSlice. A waker skips the futex syscall unless the `sleeping` flag is set; both
// sides order flag and counter with seq_cst fences (Dekker), and FUTEX_WAIT re-checks the
// counter in the kernel, so no wake-up is lost. Before waiting, a waiter checks its own
// segment's abort flag; between slices, the deadline, both segments' abort flags and
// whether the peer process still exists. A sender also rings the receiver's doorbell (in
// the receiver's segment, after the same fence), for a recv from any source that waits
// on all its channels at once.
//
// Lifetime: segments are created O_EXCL with mode 0600 under unpredictable names
// (/pycomm-<pid>-<random>) and unlinked by their creator as soon as every peer has mapped
// them, so nothing is left in /dev/shm once a group is up, even after SIGKILL. A crash
// during set-up can leave a segment: set-up removes segments whose creator pid is gone.
//
// Room: a segment's pages are allocated when it is made (posix_fallocate), not when first
// touched: on a tmpfs too small for the group (a container's 64 MiB /dev/shm) that is an
// answer at set-up (reserve_shm_segment), where a page fault past the end of room would be
// a SIGBUS in the middle of a collective.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/peer_watch.h"
#include "transport/transport.h"

namespace pycomm {
namespace {

constexpr uint64_t kSegmentMagic = 0x70796d6d53484d31ull;  // "pymmSHM1"
constexpr size_t kReasonBytes = 1024;
constexpr size_t kSlotHeaderBytes = 64;  // FrameHeader padded to a cache line
// How long a transport with device payloads waits at destruction for its peers to take
// the frames it sent last (see ShmChannel::drain).
constexpr std::chrono::milliseconds kDrainTimeout{10000};
static_assert(sizeof(FrameHeader) <= kSlotHeaderBytes, "slot header too small");

struct SegmentHeader {
  uint64_t magic;
  uint32_t owner_rank;
  uint32_t ring_count;
  uint64_t chunk_bytes;
  uint64_t depth;
  alignas(64) std::atomic<uint32_t> aborted;
  char reason[kReasonBytes];
  DoorbellWord doorbell;  // the owner's: rung by every peer that publishes a frame to it
};

struct RingControl {
  alignas(64) std::atomic<uint32_t> tail;
  alignas(64) std::atomic<uint32_t> head;
  alignas(64) std::atomic<uint32_t> receiver_sleeping;
  std::atomic<uint32_t> sender_sleeping;
};

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct Layout {
  size_t chunk_bytes, depth, ring_count;
  bool device_payloads;  // payloads in a SlotArena: slots hold headers only
  // Of a transport made with `s`: a ring to each peer.
  static Layout of(const TransportSetup& s, bool device_payloads) {
    return Layout{s.chunk_bytes ? s.chunk_bytes : s.config->shm_chunk_bytes,
                  static_cast<size_t>(s.config->pipeline_depth), s.peers.size(), device_payloads};
  }
  size_t slot_bytes() const { return kSlotHeaderBytes + (device_payloads ? 0 : chunk_bytes); }
  size_t arena_bytes() const { return ring_count * depth * chunk_bytes; }
  size_t ring_bytes() const { return round_up(sizeof(RingControl), 64) + depth * slot_bytes(); }
  size_t header_bytes() const { return round_up(sizeof(SegmentHeader), 4096); }
  size_t total() const { return header_bytes() + ring_count * ring_bytes(); }
  RingControl* control(char* base, size_t ring) const {
    return reinterpret_cast<RingControl*>(base + header_bytes() + ring * ring_bytes());
  }
  char* slot(char* base, size_t ring, size_t index) const {
    return base + header_bytes() + ring * ring_bytes() + round_up(sizeof(RingControl), 64) +
           (index % depth) * slot_bytes();
  }
};

// ThreadSanitizer keys synchronisation by address, and each side reaches a ring's counters
// through its own mapping of the segment, at another address than its peer's: TSan cannot
// see that the counters order the payloads (above). With payloads in the segment, that
// hides nothing (each side also reads the payloads at its own addresses), but a SlotArena
// that threads of one process map at the same address (the tests' stand-in device) would
// be reported as racing. So a TSan build states the counters' ordering on the payload's
// address, which both sides share: release where a counter is stored with release,
// acquire where it is loaded with acquire. Nothing in any other build.
#if defined(__SANITIZE_THREAD__)
#define PYCOMM_TSAN_ANNOTATIONS
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PYCOMM_TSAN_ANNOTATIONS
#endif
#endif
#ifdef PYCOMM_TSAN_ANNOTATIONS
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
void tsan_acquire(const void* p) { __tsan_acquire(const_cast<void*>(p)); }
void tsan_release(const void* p) { __tsan_release(const_cast<void*>(p)); }
#else
void tsan_acquire(const void*) {}
void tsan_release(const void*) {}
#endif

// Removes segments left by set-ups that crashed before unlinking (creator pid gone).
void remove_orphaned_segments() {
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  while (dirent* e = readdir(dir)) {
    int pid = 0;
    if (std::sscanf(e->d_name, "pycomm-%d-", &pid) != 1 || pid <= 0) continue;
    struct stat st{};
    const std::string path = std::string("/dev/shm/") + e->d_name;
    if (stat(path.c_str(), &st) == 0 && st.st_uid == geteuid() && !process_exists(pid))
      shm_unlink((std::string("/") + e->d_name).c_str());
  }
  closedir(dir);
}

std::string random_hex(size_t bytes) {
  std::vector<unsigned char> buf(bytes);
  if (getrandom(buf.data(), bytes, 0) != static_cast<ssize_t>(bytes))
    fail(ErrorKind::Internal, errno_message("pycomm: getrandom"));
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (unsigned char c : buf) {
    s += digits[c >> 4];
    s += digits[c & 15];
  }
  return s;
}

// One mapped segment; unmaps (and, if still named, unlinks) on destruction.
struct Mapping {
  char* base = nullptr;
  size_t bytes = 0;
  std::string name;   // non-empty while the name exists in /dev/shm and we own it
  ~Mapping() {
    if (base) munmap(base, bytes);
    if (!name.empty()) shm_unlink(name.c_str());
  }
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base); }
};

// This rank's own segment: made, its pages allocated and its header written before the
// transport that publishes it to the peers.
struct OwnSegment final : ShmSegment {
  Layout layout{};
  Mapping mapping;
};

// Null, with `shortage` set, where /dev/shm has no room for it.
std::unique_ptr<OwnSegment> create_segment(const Layout& layout, int rank, std::string& shortage) {
  remove_orphaned_segments();
  auto segment = std::make_unique<OwnSegment>();
  segment->layout = layout;
  Mapping& own = segment->mapping;
  own.bytes = layout.total();
  for (int attempt = 0;; ++attempt) {
    own.name = "/pycomm-" + std::to_string(getpid()) + "-" + random_hex(16);
    const int fd = shm_open(own.name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST && attempt < 4) continue;
    if (fd < 0) {
      const std::string name = own.name;
      own.name.clear();
      fail(ErrorKind::Internal, errno_message("pycomm: shm_open(" + name + ")"));
    }
    int error;
    do error = posix_fallocate(fd, 0, static_cast<off_t>(own.bytes));
    while (error == EINTR);
    if (error == ENOSPC) {
      close(fd);
      struct statvfs fs{};
      const double free_bytes = statvfs("/dev/shm", &fs) == 0 ? static_cast<double>(fs.f_bavail) * fs.f_frsize : 0;
      shortage = "/dev/shm has " + mebibytes(free_bytes) + " free, rank " + std::to_string(rank) + " needed " +
                 mebibytes(own.bytes);
      return nullptr;  // ~Mapping unlinks the name
    }
    if (error == 0) own.base = static_cast<char*>(mmap(nullptr, own.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    const int saved = error ? error : errno;
    close(fd);
    if (error || own.base == MAP_FAILED) {
      own.base = nullptr;
      errno = saved;
      fail(ErrorKind::Internal,
           errno_message("pycomm: cannot allocate or map " + std::to_string(own.bytes) + " bytes of shared memory"));
    }
    break;
  }
  SegmentHeader* h = new (own.base) SegmentHeader{};
  h->magic = kSegmentMagic;
  h->owner_rank = static_cast<uint32_t>(rank);
  h->ring_count = static_cast<uint32_t>(layout.ring_count);
  h->chunk_bytes = layout.chunk_bytes;
  h->depth = layout.depth;
  for (size_t r = 0; r < layout.ring_count; ++r) new (layout.control(own.base, r)) RingControl{};
  return segment;
}

class ShmTransport;

// Where the payloads of one ring's slots are: slot i's at base + (i % depth) * stride.
struct Payloads {
  char* base;
  size_t stride;
};

class ShmChannel final : public Channel {
 public:
  ShmChannel(ShmTransport* t, const PeerInfo& peer, const Layout& layout, Mapping* mine, size_t out_ring, Payloads out,
             Mapping* theirs, size_t in_ring, Payloads in)
      : transport_(t),
        peer_(peer),
        layout_(layout),
        mine_(mine),
        theirs_(theirs),
        out_(layout.control(mine->base, out_ring)),
        in_(layout.control(theirs->base, in_ring)),
        out_ring_(out_ring),
        in_ring_(in_ring),
        out_payloads_(out),
        in_payloads_(in),
        watch_(peer.pid),
        peer_doorbell_(&theirs->header()->doorbell) {}

  const PeerInfo& peer_info() const override { return peer_; }
  size_t chunk_bytes() const override { return layout_.chunk_bytes; }

  void* begin_send(const Deadline& deadline) override {
    wait_for(out_->head, out_->sender_sleeping, deadline, "free a slot for",
             [&] { return sent_ - out_->head.load(std::memory_order_acquire) < layout_.depth; });
    tsan_acquire(out_payload(sent_));
    return out_payload(sent_);
  }

  void end_send(const FrameHeader& header) override {
    std::memcpy(layout_.slot(mine_->base, out_ring_, sent_), &header, sizeof header);
    tsan_release(out_payload(sent_));
    out_->tail.store(++sent_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (out_->receiver_sleeping.load(std::memory_order_relaxed)) futex_wake_all(&out_->tail);
    peer_doorbell_.ring_after_fence();
  }

  const void* begin_recv_next(FrameHeader& got, const Deadline& deadline) override {
    wait_for(in_->tail, in_->receiver_sleeping, deadline, "receive from",
             [&] { return in_->tail.load(std::memory_order_acquire) != received_; });
    std::memcpy(&got, layout_.slot(theirs_->base, in_ring_, received_), sizeof got);
    tsan_acquire(in_payload(received_));
    return in_payload(received_);
  }

  void end_recv() override {
    tsan_release(in_payload(received_));
    in_->head.store(++received_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (in_->sender_sleeping.load(std::memory_order_relaxed)) futex_wake_all(&in_->head);
  }

  std::optional<FrameHeader> peek_recv() override;

  void wake_all() {
    futex_wake_all(&out_->tail);
    futex_wake_all(&in_->head);
  }

  // Returns once the peer has consumed every frame sent here. Device payloads live in
  // this rank's memory, unlike a shared segment, which outlives its creator while mapped:
  // they must not be freed while the peer still reads the last frames.
  void drain(const Deadline& deadline) {
    wait_for(out_->head, out_->sender_sleeping, deadline, "hand over the last frames to",
             [&] { return out_->head.load(std::memory_order_acquire) == sent_; });
    for (uint32_t i = 0; i < layout_.depth; ++i) tsan_acquire(out_payload(i));
  }

 private:
  char* out_payload(uint32_t frame) const {
    return out_payloads_.base + (frame % layout_.depth) * out_payloads_.stride;
  }
  const char* in_payload(uint32_t frame) const {
    return in_payloads_.base + (frame % layout_.depth) * in_payloads_.stride;
  }
  template <class Ready>
  void wait_for(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleeping, const Deadline& deadline,
                const char* what, Ready ready);
  void check_alive(const Deadline& deadline, const char* what);

  ShmTransport* transport_;
  PeerInfo peer_;
  Layout layout_;
  Mapping* mine_;
  Mapping* theirs_;
  RingControl* out_;
  RingControl* in_;
  size_t out_ring_, in_ring_;
  Payloads out_payloads_, in_payloads_;
  uint32_t sent_ = 0;      // frames this rank published on its outbound ring
  uint32_t received_ = 0;  // frames this rank consumed from its inbound ring
  PeerWatch watch_;
  Doorbell peer_doorbell_;
};

class ShmTransport final : public Transport {
 public:
  ShmTransport(const TransportSetup& s, std::unique_ptr<ShmSegment> segment, std::unique_ptr<SlotArena> arena)
      : spin_(s.spin),
        arena_(std::move(arena)),
        layout_(Layout::of(s, arena_ != nullptr)),
        own_segment_(take_or_create(std::move(segment), s.rank)) {
    std::vector<int> clique = s.peers;
    clique.push_back(s.rank);
    std::sort(clique.begin(), clique.end());
    const auto index_in = [&](int owner, int peer) {  // ring of owner -> peer
      size_t i = 0;
      for (int r : clique) {
        if (r == owner) continue;
        if (r == peer) return i;
        ++i;
      }
      fail(ErrorKind::Internal, "pycomm: shm ring index");
    };
    const auto key = [&](const char* what, int rank) {
      return s.key_prefix + "/shm/" + what + "/" + std::to_string(rank);
    };
    // Every peer's value of `what`, in s.peers order.
    const auto from_peers = [&](const char* what) {
      std::vector<std::string> keys;
      for (int p : s.peers) keys.push_back(key(what, p));
      return get_all(*s.store, keys, s.deadline, [&](size_t i) {
        return "pycomm: shared-memory set-up timed out waiting for " + s.ranks[s.peers[i]].describe() + " (its '" +
               what + "')";
      });
    };
    s.store->set(key("name", s.rank), own_.name);
    if (arena_) s.store->set(key("arena", s.rank), arena_->allocate(layout_.arena_bytes()));
    const std::vector<std::string> names = from_peers("name");
    const std::vector<std::string> arenas = arena_ ? from_peers("arena") : std::vector<std::string>();
    std::map<int, char*> peer_arenas;
    for (size_t i = 0; i < s.peers.size(); ++i) {
      const int p = s.peers[i];
      auto m = std::make_unique<Mapping>();
      open_peer_segment(*m, names[i], p);
      peers_.emplace(p, std::move(m));
      if (arena_) peer_arenas[p] = arena_->map(arenas[i], p);
    }
    // Everyone has mapped everything it needs once all "mapped" keys exist: then the names
    // can go, and a crash from here on leaves nothing behind.
    s.store->set(key("mapped", s.rank), "1");
    from_peers("mapped");
    shm_unlink(own_.name.c_str());
    own_.name.clear();
    channels_.resize(s.size);
    for (int p : s.peers) {
      const size_t out = index_in(s.rank, p), in = index_in(p, s.rank);
      channels_[p] = std::make_unique<ShmChannel>(
          this, s.ranks[p], layout_, &own_, out, payloads(own_.base, out, arena_ ? arena_->base() : nullptr),
          peers_.at(p).get(), in, payloads(peers_.at(p)->base, in, arena_ ? peer_arenas.at(p) : nullptr));
    }
  }

  // Ring `ring`'s payloads: after each slot's header in `segment`, or in `arena` memory.
  Payloads payloads(char* segment, size_t ring, char* arena) const {
    if (arena) return Payloads{arena + ring * layout_.depth * layout_.chunk_bytes, layout_.chunk_bytes};
    return Payloads{layout_.slot(segment, ring, 0) + kSlotHeaderBytes, layout_.slot_bytes()};
  }

  ~ShmTransport() override {
    if (arena_) {
      // Bounded: a dead or aborted peer, or one that never comes back, ends the wait.
      const Deadline deadline = Deadline::after(kDrainTimeout);
      for (auto& c : channels_) {
        try {
          if (c) c->drain(deadline);
        } catch (const Error&) {
        }
      }
    }
    channels_.clear();
    peers_.clear();
  }

  const char* name() const override { return arena_ ? arena_->kind() : "shm"; }
  DoorbellWord* doorbell() override { return &own_.header()->doorbell; }
  Channel* channel(int peer) override {
    return peer >= 0 && peer < static_cast<int>(channels_.size()) ? channels_[peer].get() : nullptr;
  }

  void abort(const std::string& reason) override {
    SegmentHeader* h = own_.header();
    uint32_t expected = 0;
    if (h->aborted.compare_exchange_strong(expected, 2, std::memory_order_acq_rel)) {
      std::strncpy(h->reason, reason.c_str(), kReasonBytes - 1);
      h->aborted.store(1, std::memory_order_release);  // reason complete before the flag reads 1
    }
    for (auto& c : channels_)
      if (c) c->wake_all();
  }

  // Throws if this transport has been aborted.
  void check_open() const {
    if (own_.header()->aborted.load(std::memory_order_acquire) == 1)
      fail(ErrorKind::PeerFailure, std::string(own_.header()->reason));
  }
  // Throws if this transport or the segment `m` (a peer's) has been aborted.
  void check_aborted(const Mapping& peer_segment, const PeerInfo& peer) const {
    check_open();
    if (peer_segment.header()->aborted.load(std::memory_order_acquire) == 1)
      fail(ErrorKind::PeerFailure, peer.describe() + " aborted: " + std::string(peer_segment.header()->reason));
  }
  const SpinPolicy& spin() const { return spin_; }

 private:
  void open_peer_segment(Mapping& m, const std::string& name, int peer) {
    if (name.rfind("/pycomm-", 0) != 0 || name.find('/', 1) != std::string::npos)
      fail(ErrorKind::Mismatch, "pycomm: rank " + std::to_string(peer) + " published an invalid segment name");
    const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0)
      fail(ErrorKind::PeerFailure, errno_message("pycomm: cannot open shared memory of rank " + std::to_string(peer)));
    struct stat st{};
    const bool sized = fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == layout_.total();
    if (sized) m.base = static_cast<char*>(mmap(nullptr, layout_.total(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    if (!sized || m.base == MAP_FAILED) {
      m.base = nullptr;
      fail(ErrorKind::Mismatch,
           "pycomm: shared memory of rank " + std::to_string(peer) +
               " has an unexpected size (PYCOMM_SHM_CHUNK_BYTES or PYCOMM_PIPELINE_DEPTH differ between ranks?)");
    }
    m.bytes = layout_.total();
    const SegmentHeader* h = m.header();
    if (h->magic != kSegmentMagic || h->owner_rank != static_cast<uint32_t>(peer) ||
        h->chunk_bytes != layout_.chunk_bytes || h->depth != layout_.depth)
      fail(ErrorKind::Mismatch, "pycomm: shared memory of rank " + std::to_string(peer) + " has a different layout");
  }

  // `segment` if made for this transport (reserve_shm_segment), else a new one.
  std::unique_ptr<OwnSegment> take_or_create(std::unique_ptr<ShmSegment> segment, int rank) const {
    if (!segment) {
      std::string shortage;
      if (auto made = create_segment(layout_, rank, shortage)) return made;
      fail(ErrorKind::InvalidArgument, "pycomm: no room in shared memory: " + shortage +
                                           " (raise the size of /dev/shm: docker run --shm-size, say)");
    }
    std::unique_ptr<OwnSegment> own(dynamic_cast<OwnSegment*>(segment.release()));
    if (!own || own->layout.total() != layout_.total() || arena_)
      fail(ErrorKind::Internal, "pycomm: shm transport given a segment made for another layout");
    return own;
  }

  SpinPolicy spin_;
  std::unique_ptr<SlotArena> arena_;  // outlives the channels, which point into it
  Layout layout_;
  std::unique_ptr<OwnSegment> own_segment_;
  Mapping& own_ = own_segment_->mapping;
  std::map<int, std::unique_ptr<Mapping>> peers_;
  std::vector<std::unique_ptr<ShmChannel>> channels_;
};

template <class Ready>
void ShmChannel::wait_for(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleeping, const Deadline& deadline,
                          const char* what, Ready ready) {
  // Aborted, every wait fails, even one that would not block (as over TCP): abort() must
  // stop every thread of this rank, whatever the peers have already sent. A peer's abort
  // is seen below, once its frames sent before are consumed (as over TCP).
  transport_->check_open();
  if (spin_until(ready, transport_->spin())) return;
  for (;;) {
    check_alive(deadline, what);
    const uint32_t seen = word.load(std::memory_order_acquire);
    sleeping.store(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (ready()) break;
    const auto slice = std::min(deadline.remaining(), std::chrono::milliseconds(kLivenessSlice));
    futex_wait(&word, seen, slice);
    if (ready()) break;
  }
  sleeping.store(0, std::memory_order_relaxed);
}

std::optional<FrameHeader> ShmChannel::peek_recv() {
  transport_->check_open();
  const auto arrived = [&] { return in_->tail.load(std::memory_order_acquire) != received_; };
  if (!arrived()) {
    transport_->check_aborted(*theirs_, peer_);
    // Frames a peer published before it exited are still delivered.
    if (watch_.exited() && !arrived()) fail(ErrorKind::PeerFailure, peer_.describe() + " exited");
    if (!arrived()) return std::nullopt;
  }
  FrameHeader got;
  std::memcpy(&got, layout_.slot(theirs_->base, in_ring_, received_), sizeof got);
  return got;
}

void ShmChannel::check_alive(const Deadline& deadline, const char* what) {
  transport_->check_aborted(*theirs_, peer_);
  if (watch_.exited()) fail(ErrorKind::PeerFailure, peer_.describe() + " exited");
  if (deadline.expired())
    fail(ErrorKind::Timeout, std::string("timed out waiting to ") + what + " " + peer_.describe());
}

}  // namespace

std::unique_ptr<ShmSegment> reserve_shm_segment(const TransportSetup& setup, std::string& shortage) {
  return create_segment(Layout::of(setup, false), setup.rank, shortage);
}

size_t shm_segment_bytes(const TransportSetup& setup) { return Layout::of(setup, false).total(); }

std::unique_ptr<Transport> make_shm_transport(const TransportSetup& setup, std::unique_ptr<ShmSegment> segment,
                                              std::unique_ptr<SlotArena> payloads) {
  return std::make_unique<ShmTransport>(setup, std::move(segment), std::move(payloads));
}

}  // namespace pycomm
