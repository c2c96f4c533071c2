// Double binary tree all-reduce, for latency-bound sizes across nodes.
//
// Trees: tree 0 is the heap-shaped binary tree over ranks (position p has children 2p+1
// and 2p+2, rank = p); tree 1 is the same shape over mirrored ranks (rank = n-1-p). The
// interior ranks of one tree are (mostly) leaves of the other, so the two trees share the
// reduction work and the links. Half h of the buffer is reduced over tree h.
// Steps per chunk c, for each half: up: receive the children's partials, add my input,
// send the partial to my parent (the root finalizes into its output); down: the root
// sends the final chunk to its children, every rank copies what its parent sends and
// forwards it. Every rank runs up(0), up(1), down(0), down(1) for chunk c, then chunk
// c+1: frames on each directed link are sent and received in that same order, each phase
// is a flow along a tree (no cycle of waits), and a rank is at most a chunk ahead of its
// neighbours, so pipeline_depth >= 2 slots suffice.
// Latency: 2 * depth = 2 * floor(log2 n) steps. Wire: partials in the accumulation format
// going up, final values in the storage format going down. Compressed: each contribution
// is quantized once as it enters the sum, partials still go up in fp32 (a tree that
// requantized them would add an error per level), and the root's result goes down
// encoded, quantized once; so only the downward half of the bytes shrinks. Bytes sent per rank: at most
// count/2 * (accum_size + 2 * element_size) per tree it is interior in. The root of each
// tree rounds each element once and all ranks copy its bits. Transports: any.
#include <vector>

#include "algorithms/algorithm.h"
#include "core/dispatch.h"

namespace pycomm {
namespace {

struct TreeLinks {
  int parent = -1;
  int child[2] = {-1, -1};
};

TreeLinks links_of(int n, int rank, int tree) {
  const auto rank_at = [&](int p) { return tree == 0 ? p : n - 1 - p; };
  const int p = tree == 0 ? rank : n - 1 - rank;
  TreeLinks t;
  if (p > 0) t.parent = rank_at((p - 1) / 2);
  for (int i = 0; i < 2; ++i)
    if (2 * p + 1 + i < n) t.child[i] = rank_at(2 * p + 1 + i);
  return t;
}

}  // namespace

void tree_allreduce(const Context& cx, const Request& rq) {
  const ReduceSpec spec = cx.spec(rq);
  const bool coded = spec.codec != Compression::None;
  const size_t es = element_size(rq.dtype), ws = accum_size(rq.dtype);
  const size_t unit = coded ? spec.block : 1;  // compressed: halves and chunks of whole blocks
  const SegmentChunks halves{Segments{rq.count, 2, unit}, cx.chunk_bytes / ws / unit * unit};
  const auto down_bytes = [&](size_t len) { return coded ? encoded_bytes(spec.codec, spec.block, len) : len * es; };
  // Compressed: each half's encoded result piece, root to leaves.
  char* const results = coded ? cx.workspace->get(Scratch::Results, 2 * down_bytes(halves.chunk)) : nullptr;
  char* const result[2] = {results, coded ? results + down_bytes(halves.chunk) : nullptr};
  ReduceSpec decode = spec;
  decode.reduction = Reduction{};
  const TreeLinks trees[2] = {links_of(cx.size, cx.rank, 0), links_of(cx.size, cx.rank, 1)};
  const auto* in = static_cast<const char*>(rq.input);
  auto* out = static_cast<char*>(rq.output);
  for (size_t c = 0; c < halves.count(); ++c) {
    for (int h = 0; h < 2; ++h) {  // up
      const TreeLinks& t = trees[h];
      size_t first, len;
      halves.piece(h, c, first, len);
      if (!len) continue;
      Term terms[3] = {{in + first * es, Form::Input}};
      int k = 1;
      for (int child : t.child)
        if (child >= 0) terms[k++] = {begin_recv_frame(cx, child, len * ws), Form::Partial};
      if (t.parent >= 0)
        send_frame(cx, t.parent, len * ws,
                   [&](void* slot) { cx.ops->reduce_terms(spec, Stage::Partial, slot, terms, k, len); });
      else if (coded) cx.ops->reduce_terms(spec, Stage::FinalEncoded, result[h], terms, k, len);
      else cx.ops->reduce_terms(spec, Stage::Final, out + first * es, terms, k, len);
      for (int child : t.child)
        if (child >= 0) end_recv_frame(cx, child);
    }
    for (int h = 0; h < 2; ++h) {  // down
      const TreeLinks& t = trees[h];
      size_t first, len;
      halves.piece(h, c, first, len);
      if (!len) continue;
      char* piece = out + first * es;
      const size_t bytes = down_bytes(len);
      void* down = coded ? static_cast<void*>(result[h]) : piece;  // what goes to the children
      if (t.parent >= 0) recv_frame(cx, t.parent, bytes, [&](const void* v) { cx.ops->copy(down, v, bytes); });
      if (coded) {  // every rank, the root included, decodes the same encoded bits
        const Term encoded{down, Form::Encoded};
        cx.ops->reduce_terms(decode, Stage::Final, piece, &encoded, 1, len);
      }
      for (int child : t.child)
        if (child >= 0) send_copy(cx, child, bytes, down);
    }
  }
}

}  // namespace pycomm
