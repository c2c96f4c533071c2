// The named steps of algorithm.h and the wire format they move data in. Transports: any.
#include <vector>

#include "algorithms/algorithm.h"
#include "core/dispatch.h"

namespace pycomm {
namespace {

// Decoding alone: no PREMUL_SUM factor (the sender applied it), no AVG division (the
// encoded value is final or partial as it was sent).
ReduceSpec decoding(ReduceSpec spec) {
  spec.reduction = Reduction{};
  return spec;
}

}  // namespace

size_t Wire::bytes(size_t len) const { return coded() ? encoded_bytes(spec.codec, spec.block, len) : len * es; }

size_t Wire::chunk(const Context& cx) const {
  return coded() ? encoded_elements_within(spec.codec, spec.block, cx.chunk_bytes) : cx.chunk_bytes / es;
}

void Wire::put(const Context& cx, void* wire, const void* contribution, size_t len) const {
  if (!coded()) return cx.ops->copy(wire, contribution, len * es);
  const Term t{contribution, Form::Input};
  cx.ops->reduce_terms(spec, Stage::Encoded, wire, &t, 1, len);
}

void Wire::send(const Context& cx, int peer, const void* contribution, size_t len) const {
  if (!coded()) return send_copy(cx, peer, len * es, contribution);
  send_frame(cx, peer, bytes(len), [&](void* slot) { put(cx, slot, contribution, len); });
}

void Wire::take(const Context& cx, void* out, const void* wire, size_t len) const {
  if (!coded()) return cx.ops->copy(out, wire, len * es);
  const Term t{wire, Form::Encoded};
  cx.ops->reduce_terms(decoding(spec), Stage::Final, out, &t, 1, len);
}

void direct_reduce_step(const Context& cx, const Request& rq, const Wire& wire, const SegmentChunks& chunks, size_t c,
                        void* out, Stage stage) {
  const int n = cx.size, r = cx.rank;
  const bool everyones = chunks.seg.parts == 1;
  const auto* in = static_cast<const char*>(rq.input);
  size_t first, len;
  if (everyones && wire.coded() && n > 2) {  // the same encoding to every peer: encode it once
    chunks.piece(0, c, first, len);
    char* const sent = cx.workspace->get(Scratch::Sent, wire.bytes(len));
    wire.put(cx, sent, in + first * wire.es, len);
    for (int k = 1; k < n && len; ++k) send_copy(cx, mod(r + k, n), wire.bytes(len), sent);
  } else {
    for (int k = 1; k < n; ++k) {  // rank r+1 first: peers are not all served in the same order
      const int s = mod(r + k, n);
      chunks.piece(everyones ? 0 : s, c, first, len);
      if (len) wire.send(cx, s, in + first * wire.es, len);
    }
  }
  chunks.piece(everyones ? 0 : r, c, first, len);
  if (!len) return;
  thread_local std::vector<Term> terms;  // kept: a small step allocates nothing
  terms.resize(n);
  for (int p = 0; p < n; ++p)
    terms[p] = p == r ? Term{in + first * wire.es, Form::Input} : wire.term(begin_recv_frame(cx, p, wire.bytes(len)));
  cx.ops->reduce_terms(wire.spec, stage, out, terms.data(), n, len);
  for (int p = 0; p < n; ++p)
    if (p != r) end_recv_frame(cx, p);
}

void direct_gather_step(const Context& cx, const Wire& wire, const SegmentChunks& chunks, size_t c, const void* mine,
                        void* out) {
  const int n = cx.size, r = cx.rank;
  auto* buf = static_cast<char*>(out);
  size_t first, len;
  chunks.piece(r, c, first, len);
  if (len)
    for (int k = 1; k < n; ++k) send_copy(cx, mod(r + k, n), wire.bytes(len), mine);
  for (int k = 1; k < n; ++k) {
    const int p = mod(r - k, n);
    chunks.piece(p, c, first, len);
    if (len)
      recv_frame(cx, p, wire.bytes(len), [&](const void* data) { wire.take(cx, buf + first * wire.es, data, len); });
  }
}

void ring_gather_step(const Context& cx, const Wire& wire, const SegmentChunks& chunks, size_t c, const void* mine,
                      void* out) {
  const int n = cx.size, r = cx.rank, right = mod(r + 1, n), left = mod(r - 1, n);
  if (n == 1) return;  // no ring: the piece is already in place
  auto* buf = static_cast<char*>(out);
  size_t first, len;
  chunks.piece(r, c, first, len);
  if (len) send_copy(cx, right, wire.bytes(len), mine);
  for (int k = 0; k <= n - 2; ++k) {  // step k: segment r-1-k arrives from the left
    chunks.piece(mod(r - 1 - k, n), c, first, len);
    if (!len) continue;
    recv_frame(cx, left, wire.bytes(len), [&](const void* data) {
      wire.take(cx, buf + first * wire.es, data, len);
      if (k < n - 2) send_copy(cx, right, wire.bytes(len), data);
    });
  }
}

}  // namespace pycomm
