// Compressed all-reduce, reduce-scatter and all-gather (numerics: DESIGN.md section 4).
//
// Error that does not grow with the world size: every contribution is quantized exactly
// once (Form::Input under a codec), the reduction of each element runs in fp32 in logical
// rank order from those quantized operands, and an all-reduce result is quantized once
// more (Stage::FinalEncoded) to travel back. Nothing is requantized per hop: where a ring
// would forward partial sums, these collectives send each contribution straight to the
// rank that reduces it, and forward only encoded results, byte for byte.
// Every rank decodes the same encoded result, the owner of a segment included, so every
// rank holds the same bits.
//
// Fusion: a peer's frame is decoded, accumulated and (for the result) encoded block by
// block straight out of its slot, in one pass (DeviceOps::reduce_terms); the only extra
// buffers are one encoded chunk (this rank's reduced piece, Scratch::Own) and, for the
// ring, the encoded chunk being forwarded (Scratch::Held), in the workspace.
//
// Layout: all-reduce segments and chunks are whole codec blocks, so blocks start at
// multiples of the block size in the tensor on every path (the quantization of a
// contribution is pycomm.quantize() of it). Reduce-scatter and all-gather blocks start
// at each rank's segment.
//
// Algorithms:
//   oneshot: every rank sends its encoded input to every peer and reduces all n; no
//     second quantization (but in deterministic modes, to give the bits of the others).
//     Bytes sent per rank: (n-1) * encoded(count).
//   twoshot: direct reduce-scatter of encoded contributions, then a direct all-gather of
//     the encoded results. Bytes sent per rank: 2 (n-1)/n * encoded(count).
//   ring: the same reduce-scatter (sending contributions to their owners in ring order),
//     then a ring all-gather forwarding the encoded results; the same bytes as twoshot,
//     on neighbour links only in its second half.
// Transports: any.
#include <vector>

#include "algorithms/algorithm.h"
#include "core/dispatch.h"

namespace pycomm {
namespace {

// Elements per frame of encoded data: whole blocks whose encoding fits one slot.
size_t coded_chunk(const Context& cx, const ReduceSpec& spec) {
  return cx.chunk_bytes / encoded_bytes(spec.codec, spec.block, spec.block) * spec.block;
}

// Decoding alone: no PREMUL_SUM factor (the sender applied it), no AVG division (the
// encoded value is final or partial as it was sent).
ReduceSpec decoding(ReduceSpec spec) {
  spec.reduction = Reduction{};
  return spec;
}

// Chunk c of an all-gather of encoded pieces: `mine` holds this rank's piece of segment
// r, encoded; every peer's piece is decoded into `out` (element type of `spec`). Direct
// sends every piece to every peer; the ring forwards each piece along r -> r+1.
void coded_gather_chunk(const Context& cx, const ReduceSpec& spec, const SegmentChunks& chunks, size_t c,
                        const char* mine, char* held, char* out, bool ring) {
  const int n = cx.size, r = cx.rank;
  const size_t es = element_size(spec.dtype);
  const ReduceSpec plain = decoding(spec);
  auto bytes = [&](size_t len) { return encoded_bytes(spec.codec, spec.block, len); };
  auto take = [&](int from, int segment, bool keep) {
    size_t first, len;
    chunks.piece(segment, c, first, len);
    if (!len) return;
    recv_frame(cx, from, bytes(len), [&](const void* data) {
      const Term t{data, Form::Encoded};
      cx.ops->reduce_terms(plain, Stage::Final, out + first * es, &t, 1, len);
      if (keep) cx.ops->copy(held, data, bytes(len));
    });
  };
  size_t first, len;
  if (!ring) {
    chunks.piece(r, c, first, len);
    if (len)
      for (int k = 1; k < n; ++k)
        send_frame(cx, mod(r + k, n), bytes(len), [&](void* slot) { cx.ops->copy(slot, mine, bytes(len)); });
    for (int k = 1; k < n; ++k) take(mod(r - k, n), mod(r - k, n), false);
    return;
  }
  for (int k = 0; k < n - 1; ++k) {  // step k: pass on segment r-k, receive segment r-k-1
    chunks.piece(mod(r - k, n), c, first, len);
    const char* piece = k == 0 ? mine : held;
    if (len) send_frame(cx, mod(r + 1, n), bytes(len), [&](void* slot) { cx.ops->copy(slot, piece, bytes(len)); });
    take(mod(r - 1, n), mod(r - k - 1, n), k + 1 < n - 1);
  }
}

}  // namespace

// Chunk c of a reduce-scatter of encoded contributions: this rank's piece of segment r,
// reduced over the team, is written to `out` (not offset) as `stage` says.
void coded_reduce_scatter_chunk(const Context& cx, const Request& rq, const SegmentChunks& chunks, size_t c,
                                void* out, Stage stage) {
  const int n = cx.size, r = cx.rank;
  const ReduceSpec spec = cx.spec(rq);
  const size_t es = element_size(rq.dtype);
  auto bytes = [&](size_t len) { return encoded_bytes(spec.codec, spec.block, len); };
  const auto* in = static_cast<const char*>(rq.input);
  size_t first, len;
  for (int k = 1; k < n; ++k) {
    const int s = mod(r + k, n);
    chunks.piece(s, c, first, len);
    const Term t{in + first * es, Form::Input};
    if (len)
      send_frame(cx, s, bytes(len), [&](void* slot) { cx.ops->reduce_terms(spec, Stage::Encoded, slot, &t, 1, len); });
  }
  chunks.piece(r, c, first, len);
  if (!len) return;
  std::vector<Term> terms(n);
  for (int p = 0; p < n; ++p)
    terms[p] = p == r ? Term{in + first * es, Form::Input} : Term{begin_recv_frame(cx, p, bytes(len)), Form::Encoded};
  cx.ops->reduce_terms(spec, stage, out, terms.data(), n, len);
  for (int p = 0; p < n; ++p)
    if (p != r) end_recv_frame(cx, p);
}

void coded_allreduce(const Context& cx, const Request& rq, Algorithm algorithm) {
  const int n = cx.size, r = cx.rank;
  const ReduceSpec spec = cx.spec(rq);
  const bool deterministic = rq.options.determinism != Determinism::Default;
  const size_t es = element_size(rq.dtype), chunk = coded_chunk(cx, spec);
  auto bytes = [&](size_t len) { return encoded_bytes(spec.codec, spec.block, len); };
  const auto* in = static_cast<const char*>(rq.input);
  auto* out = static_cast<char*>(rq.output);
  char* const mine = cx.workspace->get(Scratch::Own, bytes(chunk));
  char* const held = algorithm == Algorithm::Ring ? cx.workspace->get(Scratch::Held, bytes(chunk)) : nullptr;
  if (algorithm == Algorithm::OneShot) {
    const SegmentChunks chunks{Segments{rq.count, 1, spec.block}, chunk};
    std::vector<Term> terms(n);
    for (size_t c = 0; c < chunks.count(); ++c) {
      size_t first, len;
      chunks.piece(0, c, first, len);
      const Term own{in + first * es, Form::Input};
      cx.ops->reduce_terms(spec, Stage::Encoded, mine, &own, 1, len);
      for (int k = 1; k < n; ++k)
        send_frame(cx, mod(r + k, n), bytes(len), [&](void* slot) { cx.ops->copy(slot, mine, bytes(len)); });
      for (int p = 0; p < n; ++p)
        terms[p] = p == r ? own : Term{begin_recv_frame(cx, p, bytes(len)), Form::Encoded};
      if (deterministic) {  // the result quantized once more, as every other algorithm does
        cx.ops->reduce_terms(spec, Stage::FinalEncoded, mine, terms.data(), n, len);
        const Term result{mine, Form::Encoded};
        cx.ops->reduce_terms(decoding(spec), Stage::Final, out + first * es, &result, 1, len);
      } else {
        cx.ops->reduce_terms(spec, Stage::Final, out + first * es, terms.data(), n, len);
      }
      for (int p = 0; p < n; ++p)
        if (p != r) end_recv_frame(cx, p);
    }
    return;
  }
  // twoshot and ring. In place is safe: chunk c of the input is sent (encoded) or reduced
  // before any piece of chunk c of the output is written.
  const SegmentChunks chunks{Segments{rq.count, static_cast<size_t>(n), spec.block}, chunk};
  for (size_t c = 0; c < chunks.count(); ++c) {
    coded_reduce_scatter_chunk(cx, rq, chunks, c, mine, Stage::FinalEncoded);
    size_t first, len;
    chunks.piece(r, c, first, len);
    const Term result{mine, Form::Encoded};
    cx.ops->reduce_terms(decoding(spec), Stage::Final, out + first * es, &result, 1, len);
    coded_gather_chunk(cx, spec, chunks, c, mine, held, out, algorithm == Algorithm::Ring);
  }
}

// Deterministic modes quantize the result once more, like the all-reduce, so that a
// shard equals the matching slice of the all-reduce where the shards start on a block of
// the tensor (count a multiple of the block).
void coded_reduce_scatter(const Context& cx, const Request& rq) {
  const ReduceSpec spec = cx.spec(rq);
  const bool deterministic = rq.options.determinism != Determinism::Default;
  const size_t es = element_size(rq.dtype), chunk = coded_chunk(cx, spec);
  const SegmentChunks chunks{Segments{rq.count * cx.size, static_cast<size_t>(cx.size)}, chunk};
  char* const mine = deterministic ? cx.workspace->get(Scratch::Own, encoded_bytes(spec.codec, spec.block, chunk)) : nullptr;
  auto* out = static_cast<char*>(rq.output);
  for (size_t c = 0; c < chunks.count(); ++c) {
    char* piece = out + c * chunks.chunk * es;
    if (!deterministic) {
      coded_reduce_scatter_chunk(cx, rq, chunks, c, piece, Stage::Final);
      continue;
    }
    coded_reduce_scatter_chunk(cx, rq, chunks, c, mine, Stage::FinalEncoded);
    size_t first, len;
    chunks.piece(cx.rank, c, first, len);
    const Term result{mine, Form::Encoded};
    cx.ops->reduce_terms(decoding(spec), Stage::Final, piece, &result, 1, len);
  }
}

void coded_allgather(const Context& cx, const Request& rq, Algorithm algorithm) {
  const ReduceSpec spec = cx.spec(rq);
  const size_t es = element_size(rq.dtype), chunk = coded_chunk(cx, spec);
  const SegmentChunks chunks{Segments{rq.count * cx.size, static_cast<size_t>(cx.size)}, chunk};
  const auto* in = static_cast<const char*>(rq.input);
  auto* out = static_cast<char*>(rq.output);
  const size_t piece_bytes = encoded_bytes(spec.codec, spec.block, chunk);
  char* const mine = cx.workspace->get(Scratch::Own, piece_bytes);
  char* const held = algorithm == Algorithm::Ring ? cx.workspace->get(Scratch::Held, piece_bytes) : nullptr;
  for (size_t c = 0; c < chunks.count(); ++c) {
    size_t first, len;
    chunks.piece(cx.rank, c, first, len);
    if (len) {  // this rank's piece, quantized like every peer's copy of it
      const Term own{in + (first - chunks.seg.begin(cx.rank)) * es, Form::Input};
      cx.ops->reduce_terms(spec, Stage::Encoded, mine, &own, 1, len);
      const Term result{mine, Form::Encoded};
      cx.ops->reduce_terms(decoding(spec), Stage::Final, out + first * es, &result, 1, len);
    }
    coded_gather_chunk(cx, spec, chunks, c, mine, held, out, algorithm == Algorithm::Ring);
  }
}

}  // namespace pycomm
