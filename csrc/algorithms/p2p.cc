// Point-to-point send and recv (see p2p.h for the matching rules). A send completes once
// its last frame is in a slot (at most pipeline_depth frames are buffered); larger
// messages wait for the receiver. Transports: any. The application's buffers are cx.ops'
// memory and are touched by cx.ops alone; the channels' slots and the held messages are
// host memory.
#include "algorithms/p2p.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "core/error.h"

namespace pycomm {
namespace {

// The bytes of the message a send frame belongs to, once check_well_formed() passed.
size_t message_bytes(const OpStamp& op) {
  const size_t es = element_size(static_cast<DataType>(op.dtype));
  return op.count > std::numeric_limits<size_t>::max() / es ? std::numeric_limits<size_t>::max()
                                                            : static_cast<size_t>(op.count) * es;
}

bool is_send(const OpStamp& op) { return op.collective == static_cast<uint8_t>(Collective::Send); }

// Throws unless `theirs`, a message with the tag of the recv `mine`, fits it.
void check_matches(const OpStamp& theirs, const OpStamp& mine, const PeerInfo& peer) {
  if (theirs.count != mine.count || theirs.dtype != mine.dtype)
    fail(ErrorKind::Mismatch, peer.describe() + " is in " + describe(theirs) + " but this rank is in " +
                                  describe(mine) + ": the sizes or dtypes of a send and the recv of its tag differ");
}

// Throws unless a frame of `len` bytes can be part of a message of `total` bytes of which
// `got` have arrived: an empty message is one empty frame, any other frame carries bytes.
void check_frame_fits(size_t len, size_t got, size_t total, const OpStamp& op, const PeerInfo& peer) {
  if (len > total - got || (len == 0 && total != 0))
    fail(ErrorKind::Mismatch, "malformed frame from " + peer.describe() + ": " + std::to_string(len) + " bytes after " +
                                  std::to_string(got) + " of " + describe(op));
}

}  // namespace

void p2p_send(const Context& cx, const Request& rq) {
  const auto* p = static_cast<const char*>(rq.input);
  const size_t bytes = rq.count * element_size(rq.dtype);
  size_t off = 0;
  do {  // an empty message is one empty frame, so that its recv is matched like any other
    const size_t len = std::min(cx.chunk_bytes, bytes - off);
    send_copy(cx, rq.root, len, p + off);
    off += len;
  } while (off < bytes);
}

void p2p_recv(const Context& cx, const Request& rq) { cx.inbox->receive(cx, cx.to(rq.root), rq); }

void p2p_recv_from_any(const Context& cx, const Request& rq) {
  Context recv = cx;
  Request from = rq;
  std::unique_lock<std::mutex> held;
  from.root = cx.senders->match(recv, rq.tag, held);
  p2p_recv(recv, from);
  if (rq.source) *rq.source = from.root;
}

void Inbox::receive(const Context& cx, Channel& ch, const Request& rq) {
  const PeerInfo& peer = ch.peer_info();
  const OpStamp& mine = cx.stamp;
  const size_t bytes = rq.count * element_size(rq.dtype);
  auto* out = static_cast<char*>(rq.output);
  OpStamp sent;
  size_t got = 0;
  const auto take = [&](const FrameHeader& h, const void* payload) {  // a frame of this message
    check_frame_fits(h.bytes, got, bytes, h.op, peer);
    cx.ops->copy(out + got, payload, h.bytes);
    ch.end_recv();
    if (cx.trace) cx.trace->frame(mine, false, peer.rank, h.bytes);
    got += h.bytes;
  };
  const auto first = std::find_if(held_.begin(), held_.end(), [&](const Held& m) { return m.stamp.root == mine.root; });
  if (first != held_.end()) {
    check_matches(first->stamp, mine, peer);
    sent = first->stamp;
    got = first->got;
    cx.ops->copy(out, first->data.data(), got);
    held_bytes_ -= first->data.size();
    held_.erase(first);  // if incomplete, it was the last held: its rest comes next
  } else {
    for (;;) {
      FrameHeader h;
      const void* payload = ch.begin_recv_next(h, cx.deadline);
      check_well_formed(h, peer);
      if (continues_held(h, peer)) {
        append_to_held(ch, h, payload);
        continue;
      }
      if (!is_send(h.op)) fail_mismatch(h.op, mine, peer);
      if (h.op.root != mine.root) {
        if (!fits(h.op) && !awaited(h.op.root))
          fail(ErrorKind::Mismatch,
               peer.describe() + " sent " + describe(h.op) + " before the message of " + describe(mine) +
                   ", and the messages of other tags waiting to be received would pass the " + std::to_string(limit_) +
                   " bytes this pair holds: post the recv of tag " + std::to_string(h.op.root) +
                   " first (irecv), or receive them in the order they were sent");
        hold(ch, h, payload);
        continue;
      }
      check_matches(h.op, mine, peer);
      sent = h.op;
      take(h, payload);
      break;
    }
  }
  while (got < bytes) {  // the rest of the message: the frames that follow its first
    FrameHeader h;
    const void* payload = ch.begin_recv_next(h, cx.deadline);
    check_well_formed(h, peer);
    if (!(h.op == sent)) fail_mismatch(h.op, mine, peer);
    take(h, payload);
  }
}

bool Inbox::offers(Channel& ch, int tag) {
  if (std::any_of(held_.begin(), held_.end(), [&](const Held& m) { return m.stamp.root == tag; })) return true;
  for (;;) {
    const std::optional<FrameHeader> next = ch.peek_recv();
    if (!next) return false;
    check_well_formed(*next, ch.peer_info());
    const bool continues = continues_held(*next, ch.peer_info());
    // A collective's frame: the peer has moved on to the group's next collective.
    if (!continues && !is_send(next->op)) return false;
    if (!continues && next->op.root == tag) return true;
    if (!continues && !fits(next->op)) return false;  // left for a recv of its tag
    FrameHeader h;
    const void* payload = ch.begin_recv_next(h, Deadline::after(std::chrono::milliseconds(0)));
    continues ? append_to_held(ch, h, payload) : hold(ch, h, payload);
  }
}

bool Inbox::continues_held(const FrameHeader& h, const PeerInfo& peer) const {
  if (held_.empty() || held_.back().got == held_.back().data.size()) return false;
  if (!(h.op == held_.back().stamp))
    fail(ErrorKind::Mismatch, "malformed stream from " + peer.describe() + ": " + describe(h.op) + " starts inside " +
                                  describe(held_.back().stamp));
  return true;
}

void Inbox::append_to_held(Channel& ch, const FrameHeader& h, const void* payload) {
  Held& m = held_.back();
  check_frame_fits(h.bytes, m.got, m.data.size(), h.op, ch.peer_info());
  if (h.bytes) std::memcpy(m.data.data() + m.got, payload, h.bytes);  // an empty message holds no buffer
  m.got += h.bytes;
  ch.end_recv();
}

void Inbox::posted(int tag) {
  std::lock_guard<std::mutex> lock(*posted_mutex_);
  ++posted_[tag];
}

void Inbox::started(int tag) {
  std::lock_guard<std::mutex> lock(*posted_mutex_);
  const auto it = posted_.find(tag);
  if (it != posted_.end() && --it->second == 0) posted_.erase(it);  // a recv that was never posted: none
}

bool Inbox::awaited(int tag) const {
  const auto held = std::count_if(held_.begin(), held_.end(), [&](const Held& m) { return m.stamp.root == tag; });
  std::lock_guard<std::mutex> lock(*posted_mutex_);
  const auto it = posted_.find(tag);
  return it != posted_.end() && it->second > held;
}

bool Inbox::fits(const OpStamp& op) const {
  const size_t bytes = message_bytes(op);
  return bytes <= limit_ && held_bytes_ <= limit_ - bytes;
}

void Inbox::hold(Channel& ch, const FrameHeader& h, const void* payload) {
  Held m;
  m.stamp = h.op;
  m.data.resize(message_bytes(h.op));
  held_bytes_ += m.data.size();
  held_.push_back(std::move(m));
  append_to_held(ch, h, payload);
}

}  // namespace pycomm
