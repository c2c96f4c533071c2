#include <algorithm>

#include "algorithms/algorithm.h"

namespace pycomm {

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
