// Point-to-point matched by (source, tag) per pair, as Gloo does.
//
// A pair's channel delivers frames in send order, and a rank's sends to one peer run one
// at a time, so each message is a contiguous run of frames: at least one, then as many as
// its bytes need at the group's chunk size, each stamped with the sender's stamp (the
// pair's send count as seq, the tag as root). A recv takes the first message from its peer
// with its tag; messages of other tags in front of it move out of the slots into the
// pair's Inbox, at most `limit` bytes of them, until a recv of their tag takes them (past
// the limit too where a recv of their tag is already posted: its buffer is the
// application's promise to take the message). So messages of one tag arrive in send
// order, and the slots never hold a message hostage.
// A message matched to a recv must have its count and dtype; anything else (a frame of a
// collective, another size) is a Mismatch error naming both sides' operations. The
// stamp's variant is not matched: it says how the sender's side ran (p2p, p2p-via-host).
//
// Buffers in a device's memory (the plan's p2p-via-host) travel over the same host
// channels: the context's ops are the device's, and they copy each frame between the
// buffer and the channel's slot (device to host straight into the send slot, host to
// device straight out of the received frame or the held message), so the binding stages
// nothing. A pair has no device channel: those are set up by a collective that every
// rank joins, which a send cannot make its peers do.
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "algorithms/algorithm.h"

namespace pycomm {

// Finds the sender of a recv from any source; the group's owner of the pairs' inboxes and
// receive sides implements it (the communicator).
class SenderMatch {
 public:
  // Waits for the first peer that offers a message with `tag` (Inbox::offers) and returns
  // it, `held` locking that peer's receive side; points `recv` (the recv's context) at the
  // pair: its inbox, and the pair's next recv number as stamp.seq. Timeout at the
  // deadline; a peer's failure once every peer has failed or left.
  virtual int match(Context& recv, int tag, std::unique_lock<std::mutex>& held) = 0;

 protected:
  ~SenderMatch() = default;
};

// One pair's messages taken from its channel ahead of their recv. Used by one thread at a
// time: the one that holds the pair's receive side (Communicator::receiving_).
class Inbox {
 public:
  explicit Inbox(size_t limit = 0) : limit_(limit) {}
  // Receives the next message with cx.stamp's tag into rq.output (rq.count elements of
  // rq.dtype): a held one first, else from `ch`, holding the messages it passes.
  void receive(const Context& cx, Channel& ch, const Request& rq);
  // Never waits: whether a message with `tag` is held, or is at the head of `ch` once the
  // complete messages in front of it are held (as far as the limit allows). Throws as
  // ch.peek_recv() does once nothing can arrive and nothing of `tag` is held.
  bool offers(Channel& ch, int tag);
  // A recv of `tag` from this pair's peer was posted (it waits for its turn on the peer's
  // lane), or has started. Any thread.
  void posted(int tag);
  void started(int tag);

 private:
  struct Held {
    OpStamp stamp;           // the sender's
    std::vector<char> data;  // the whole message
    size_t got = 0;          // bytes received so far
  };
  // Whether `h`, the frame at the head of a channel, continues the last held message,
  // which is incomplete (its bytes then go there); throws when that message is incomplete
  // and `h` does not continue it.
  bool continues_held(const FrameHeader& h, const PeerInfo& peer) const;
  void append_to_held(Channel& ch, const FrameHeader& h, const void* payload);
  // Whether a message stamped `op` fits beside what is held.
  bool fits(const OpStamp& op) const;
  // Whether more recvs of `tag` are posted than messages of it are held: the next message
  // of `tag` has a posted recv waiting for it.
  bool awaited(int tag) const;
  void hold(Channel& ch, const FrameHeader& h, const void* payload);

  std::deque<Held> held_;
  size_t held_bytes_ = 0;
  size_t limit_;
  std::unique_ptr<std::mutex> posted_mutex_ = std::make_unique<std::mutex>();
  std::map<int, int> posted_;  // by tag: recvs posted and not started
};

}  // namespace pycomm
