// The TCP transport's bytes on the wire, apart from the sockets that carry them: the
// handshake message that opens every connection (tcp_mesh.cc runs the exchange) and the
// frames that follow it. Every check of received bytes here is plain code over a buffer,
// which tests/cpp/test_wire_fuzz.cc feeds random, truncated and corrupted bytes directly.
//
// Frames. Each frame is a FrameHeader (48 bytes) followed by `bytes` payload bytes: Data
// frames carry at most the channel's chunk; an Abort frame carries the reason (<=
// kMaxReason, shown as printable text). Every received header is checked (magic, kind,
// size) before its payload is read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "core/wire.h"

namespace pycomm {
namespace tcp {

constexpr size_t kMaxSecret = 64;  // bytes of the group secret a handshake carries
constexpr uint32_t kHelloMagic = 0x70634843;  // "pcHC": connector -> acceptor
constexpr uint32_t kAckMagic = 0x70634841;    // "pcHA": acceptor -> connector
constexpr uint32_t kNackMagic = 0x7063484e;   // "pcHN": acceptor -> connector, its own one wins
constexpr uint32_t kProtocolVersion = 2;

// The handshake message, both directions (magic tells which). Native byte order, like
// FrameHeader.
struct Hello {
  uint32_t magic = 0;
  uint32_t version = 0;
  int32_t from_rank = -1;
  int32_t to_rank = -1;
  uint32_t secret_bytes = 0;
  uint32_t reserved = 0;
  unsigned char secret[kMaxSecret] = {};
};
static_assert(sizeof(Hello) == 88, "Hello is a wire format");
constexpr size_t kHelloBytes = sizeof(Hello);

// A message of kind `magic` from rank `from` to rank `to` that proves `secret` (at most
// kMaxSecret bytes).
Hello make_hello(uint32_t magic, int from, int to, const std::string& secret);

// A handshake message as received: `message` is valid where `error` is null; otherwise
// `error` says, in printable text, which check it failed first.
struct DecodedHello {
  Hello message;
  const char* error = nullptr;
};

// Decodes `n` received bytes as a handshake message of kind `magic` (Hello, Ack or Nack)
// for rank `to` that proves `secret`; the sender's rank is the caller's to check. Exactly
// kHelloBytes are a message. Reserved must be zero, so that every byte of the message is
// checked. The secret is compared even when the rest is invalid, to keep timing uniform.
DecodedHello decode_hello(const void* bytes, size_t n, uint32_t magic, int to, const std::string& secret);

constexpr size_t kMaxReason = 1024;  // Abort frame payload cap
constexpr size_t kHeaderBytes = sizeof(FrameHeader);

// Why the received header `h` cannot start a frame on a channel of `chunk`-byte slots (bad
// magic, unknown kind, a payload over the chunk or an abort reason over kMaxReason), or ""
// when it can.
std::string header_error(const FrameHeader& h, size_t chunk);

// The Abort frame that carries `reason`, cut to kMaxReason bytes.
std::string abort_frame(const std::string& reason);

// A peer's abort reason as it goes into an error message: printable ASCII, any other byte
// as \xNN. The bytes come off the wire: a NUL would cut the message short, bytes that are
// not UTF-8 would fail its conversion to a Python string, control characters could forge
// log lines.
std::string printable_reason(const char* p, size_t n);

// The reason (printable) of the Abort frame among `n` received bytes that start at a frame
// boundary, stepping over Data frames of at most `chunk` bytes; none where anything else
// comes first or the Abort frame is not all there.
std::optional<std::string> find_abort_reason(const char* p, size_t n, size_t chunk);

}  // namespace tcp
}  // namespace pycomm
