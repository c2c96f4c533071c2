#include <algorithm>

#include "algorithms/algorithm.h"
#include "core/config.h"

namespace pycomm {

void FrameTrace::frame(const OpStamp& op, bool sent, int group_peer, size_t bytes) const {
  log_line(prefix + describe(op) + (sent ? ": sent " : ": received ") + std::to_string(bytes) + " B " +
           (sent ? "to" : "from") + " rank " + std::to_string(group_peer));
}

void send_bytes(const Context& cx, int peer, const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  for (size_t off = 0; off < bytes; off += cx.chunk_bytes) {
    const size_t len = std::min(cx.chunk_bytes, bytes - off);
    send_frame(cx, peer, len, [&](void* slot) { cx.ops->copy(slot, p + off, len); });
  }
}

void recv_bytes(const Context& cx, int peer, void* data, size_t bytes) {
  auto* p = static_cast<char*>(data);
  for (size_t off = 0; off < bytes; off += cx.chunk_bytes) {
    const size_t len = std::min(cx.chunk_bytes, bytes - off);
    recv_frame(cx, peer, len, [&](const void* slot) { cx.ops->copy(p + off, slot, len); });
  }
}

}  // namespace pycomm
