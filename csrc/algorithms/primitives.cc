#include <algorithm>

#include "algorithms/algorithm.h"
#include "core/config.h"

namespace pycomm {

void FrameTrace::frame(const OpStamp& op, bool sent, int group_peer, size_t bytes) const {
  log_line(prefix + describe(op) + (sent ? ": sent " : ": received ") + std::to_string(bytes) + " B " +
           (sent ? "to" : "from") + " rank " + std::to_string(group_peer));
}

void send_copy(const Context& cx, int peer, size_t bytes, const void* src) {
  if (cx.ops != &cpu_ops()) return send_frame(cx, peer, bytes, [&](void* slot) { cx.ops->copy(slot, src, bytes); });
  const FrameHeader h = next_frame_header(cx, bytes);
  cx.to(peer).send_host(h, src, cx.deadline);
  if (cx.trace) cx.trace->frame(cx.stamp, true, cx.group_rank(peer), bytes);
}

void send_bytes(const Context& cx, int peer, const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  for (size_t off = 0; off < bytes; off += cx.chunk_bytes)
    send_copy(cx, peer, std::min(cx.chunk_bytes, bytes - off), p + off);
}

void recv_bytes(const Context& cx, int peer, void* data, size_t bytes) {
  auto* p = static_cast<char*>(data);
  for (size_t off = 0; off < bytes; off += cx.chunk_bytes) {
    const size_t len = std::min(cx.chunk_bytes, bytes - off);
    recv_frame(cx, peer, len, [&](const void* slot) { cx.ops->copy(p + off, slot, len); });
  }
}

size_t ByteRuns::total() const {
  size_t t = 0;
  for (const Run& r : runs) t += r.bytes;
  return t;
}

namespace {

// Walks a ByteRuns stream: `take(len, f)` calls f(run pointer, bytes) for the next `len`
// bytes of the stream, run by run.
class RunCursor {
 public:
  explicit RunCursor(const ByteRuns& b) : b_(b) {}
  template <class F>
  void take(size_t len, F f) {
    while (len) {
      const ByteRuns::Run& run = b_.runs[run_];
      const size_t n = std::min(len, run.bytes - offset_);
      f(run.data + offset_, n);
      len -= n;
      offset_ += n;
      if (offset_ == run.bytes) ++run_, offset_ = 0;
    }
  }

 private:
  const ByteRuns& b_;
  size_t run_ = 0, offset_ = 0;
};

}  // namespace

void exchange_bytes(const Context& cx, int to, const ByteRuns& out, int from, const ByteRuns& in) {
  const size_t out_bytes = out.total(), in_bytes = in.total();
  RunCursor sending(out), receiving(in);
  for (size_t off = 0; off < std::max(out_bytes, in_bytes); off += cx.chunk_bytes) {
    if (off < out_bytes) {
      const size_t len = std::min(cx.chunk_bytes, out_bytes - off);
      send_frame(cx, to, len, [&](void* slot) {
        char* p = static_cast<char*>(slot);
        sending.take(len, [&](const char* data, size_t n) {
          cx.ops->copy(p, data, n);
          p += n;
        });
      });
    }
    if (off < in_bytes) {
      const size_t len = std::min(cx.chunk_bytes, in_bytes - off);
      recv_frame(cx, from, len, [&](const void* slot) {
        const char* p = static_cast<const char*>(slot);
        receiving.take(len, [&](char* data, size_t n) {
          cx.ops->copy(data, p, n);
          p += n;
        });
      });
    }
  }
}

}  // namespace pycomm
