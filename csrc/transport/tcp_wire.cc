#include "transport/tcp_wire.h"

#include <cstring>

namespace pycomm {
namespace tcp {
namespace {

// Compares the whole secret field and its length whatever their contents, so the time
// taken tells nothing about how much of a guess was right.
bool secret_matches(const Hello& h, const std::string& secret) {
  unsigned char expected[kMaxSecret] = {};
  std::memcpy(expected, secret.data(), secret.size());
  uint32_t diff = h.secret_bytes ^ static_cast<uint32_t>(secret.size());
  for (size_t i = 0; i < kMaxSecret; ++i) diff |= static_cast<uint32_t>(h.secret[i] ^ expected[i]);
  return diff == 0;
}

}  // namespace

Hello make_hello(uint32_t magic, int from, int to, const std::string& secret) {
  Hello h;
  h.magic = magic;
  h.version = kProtocolVersion;
  h.from_rank = from;
  h.to_rank = to;
  h.secret_bytes = static_cast<uint32_t>(secret.size());
  std::memcpy(h.secret, secret.data(), secret.size());
  return h;
}

DecodedHello decode_hello(const void* bytes, size_t n, uint32_t magic, int to, const std::string& secret) {
  DecodedHello d;
  if (n < kHelloBytes) d.error = "truncated handshake message";
  else if (n > kHelloBytes) d.error = "over-long handshake message";
  if (d.error) return d;
  std::memcpy(&d.message, bytes, kHelloBytes);
  const Hello& h = d.message;
  const bool secret_ok = secret_matches(h, secret);
  if (h.magic != magic) d.error = "unexpected magic";
  else if (h.version != kProtocolVersion) d.error = "unsupported protocol version";
  else if (h.reserved != 0) d.error = "reserved field not zero";
  else if (h.to_rank != to) d.error = "addressed to another rank";
  else if (!secret_ok) d.error = "wrong secret";
  return d;
}

std::string header_error(const FrameHeader& h, size_t chunk) {
  if (h.magic != kFrameMagic) return "bad magic";
  if (h.kind == static_cast<uint16_t>(FrameKind::Data)) {
    if (h.bytes > chunk)
      return "a payload of " + std::to_string(h.bytes) + " bytes exceeds this rank's chunk of " +
             std::to_string(chunk) + " bytes (do PYCOMM_TCP_CHUNK_BYTES differ between ranks?)";
    return "";
  }
  if (h.kind == static_cast<uint16_t>(FrameKind::Abort))
    return h.bytes > kMaxReason ? "abort reason of " + std::to_string(h.bytes) + " bytes" : "";
  return "unknown frame kind " + std::to_string(h.kind);
}

std::string abort_frame(const std::string& reason) {
  const std::string cut = reason.substr(0, kMaxReason);
  FrameHeader h;
  h.kind = static_cast<uint16_t>(FrameKind::Abort);
  h.bytes = static_cast<uint32_t>(cut.size());
  return std::string(reinterpret_cast<const char*>(&h), sizeof h) + cut;
}

std::string printable_reason(const char* p, size_t n) {
  static const char hex[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(p[i]);
    if (c >= 0x20 && c < 0x7f) s += static_cast<char>(c);
    else s += {'\\', 'x', hex[c >> 4], hex[c & 15]};
  }
  return s;
}

std::optional<std::string> find_abort_reason(const char* p, size_t n, size_t chunk) {
  for (size_t pos = 0; pos + kHeaderBytes <= n;) {
    FrameHeader h;
    std::memcpy(&h, p + pos, kHeaderBytes);
    if (h.magic != kFrameMagic) break;
    if (h.kind == static_cast<uint16_t>(FrameKind::Data) && h.bytes <= chunk) {
      pos += kHeaderBytes + h.bytes;
      continue;
    }
    if (h.kind == static_cast<uint16_t>(FrameKind::Abort) && h.bytes <= kMaxReason && pos + kHeaderBytes + h.bytes <= n)
      return printable_reason(p + pos + kHeaderBytes, h.bytes);
    break;
  }
  return std::nullopt;
}

}  // namespace tcp
}  // namespace pycomm
