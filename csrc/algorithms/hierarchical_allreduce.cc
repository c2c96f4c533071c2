// Hierarchical all-reduce, for several nodes with equal numbers of ranks (L per node, N
// nodes): the fast intra-node links carry most of the traffic, the slow inter-node links
// only 1/L of it.
// Steps:
//   1. intra-node direct reduce-scatter: local rank l ends with shard l of its node's sum,
//      kept in the accumulation format (not rounded yet);
//   2. inter-node ring all-reduce of shard l among the N ranks with local index l (one
//      ring per local index, all running at once), still in the accumulation format;
//   3. finalize shard l (AVG divides by the world size) and round it once into the output;
//   4. intra-node direct all-gather of the shards.
// Bytes sent per rank: intra 2 (L-1)/L * count * element_size; inter 2 (N-1)/N * count/L
// * accum_size, against 2 (n-1)/n * count * accum_size for a flat ring whose every link
// carries the full stream. Transports: shared memory within nodes, TCP between them (any
// works). Compressed: only step 2 is, on the node's partial sums (each quantized once,
// the result once more; see algorithm.h); the intra-node steps stay exact.
//
// Overlap. A large buffer is cut into slices of whole chunks. A helper thread runs step 2
// slice by slice while this thread runs step 1 on later slices and steps 3-4 on earlier
// ones, so the intra-node phases hide behind the slow link instead of adding to it.
// The two threads use disjoint channels (intra-node peers here, inter-node peers there),
// so each channel still sees one thread and frames in one order. Hand-offs go through the
// mutex: slice s's partials are written before `posted` covers s, and reduced across nodes
// before `done` covers it. A failure on either thread aborts the group's transports, which
// ends every wait of the other thread; the first failure is the one reported.
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "algorithms/algorithm.h"
#include "core/dispatch.h"
#include "core/error.h"

namespace pycomm {
namespace {

// Slices: at most kMaxSlices, of at least kMinSliceChunks chunks, so that a helper thread
// is started only when there is a transfer long enough to hide something behind.
constexpr size_t kMaxSlices = 32, kMinSliceChunks = 4;

// The inter-node all-reduces of posted slices, in order, on a helper thread.
class InterNodeLane {
 public:
  InterNodeLane(const Context& cx, size_t slices, std::function<void(size_t)> reduce_slice)
      : cx_(cx), slices_(slices), reduce_slice_(std::move(reduce_slice)), thread_([this] { main(); }) {}
  ~InterNodeLane() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      posted_ = slices_;  // a lane waiting for work ends; one in a transfer ends by abort
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(size_t slice) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      posted_ = slice + 1;
    }
    cv_.notify_all();
  }
  // Blocks until `slice` is reduced across nodes; rethrows the lane's failure.
  void wait_done(size_t slice) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, cx_.deadline.at, [&] { return done_ > slice || failure_; }))
      fail(ErrorKind::Timeout, "pycomm: timed out waiting for the inter-node phase of slice " + std::to_string(slice));
    if (failure_) std::rethrow_exception(failure_);
  }
  std::exception_ptr failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }

 private:
  void main() {
    try {
      for (size_t s = 0; s < slices_; ++s) {
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return posted_ > s; });
          if (stop_) return;
        }
        reduce_slice_(s);
        {
          std::lock_guard<std::mutex> lock(mu_);
          done_ = s + 1;
        }
        cv_.notify_all();
      }
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        failure_ = std::current_exception();
      }
      cv_.notify_all();
      cx_.abort(e.what());
    }
  }

  const Context& cx_;
  const size_t slices_;
  std::function<void(size_t)> reduce_slice_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t posted_ = 0, done_ = 0;
  bool stop_ = false;
  std::exception_ptr failure_;
  std::thread thread_;  // last: starts after every other member is ready
};

}  // namespace

void hierarchical_allreduce(const Context& cx, const Request& rq) {
  const Topology& topo = *cx.topology;
  const int me = cx.group_rank(cx.rank);
  const std::vector<int>& node = topo.nodes[topo.node_of[me]];
  const int local = static_cast<int>(std::find(node.begin(), node.end(), me) - node.begin());
  std::vector<int> peers_at_local;  // the ranks with my local index, one per node
  for (const auto& n : topo.nodes) peers_at_local.push_back(n[local]);
  const Context intra = cx.team(node), inter = cx.team(peers_at_local);

  const size_t es = element_size(rq.dtype), ws = accum_size(rq.dtype);
  const SegmentChunks shards{Segments{rq.count, node.size()}, cx.chunk_bytes / es};
  const size_t shard_len = shards.seg.length(local);
  char* const partial = cx.workspace->get(Scratch::Partials, shard_len * ws);  // fp32 partials of my shard
  // Slice s covers chunks [s * per_slice, (s + 1) * per_slice); every rank cuts alike.
  const size_t chunks = shards.count();
  const size_t per_slice = std::max(kMinSliceChunks, ceil_div(chunks, kMaxSlices));
  const size_t slices = std::max<size_t>(1, ceil_div(chunks, per_slice));
  auto elements_of = [&](size_t s, size_t& first, size_t& len) {
    first = std::min(shard_len, s * per_slice * shards.chunk);
    len = std::min(shard_len, (s + 1) * per_slice * shards.chunk) - first;
  };

  Request within = rq;  // within a node nothing is compressed: the links are fast
  within.options.compression = Compression::None;
  Request across = rq;  // partials combine with the operator alone
  across.dtype = accumulation_type(rq.dtype);
  const ReduceKind k = rq.reduction.kind;
  across.reduction = Reduction{k == ReduceKind::Avg || k == ReduceKind::PremulSum ? ReduceKind::Sum : k, 1.0};
  auto reduce_across = [&](size_t s) {  // 2
    size_t first, len;
    elements_of(s, first, len);
    Request part = across;
    part.input = part.output = partial + first * ws;
    part.count = len;
    (part.options.compression != Compression::None ? direct_ring_allreduce : ring_allreduce)(inter, part);
  };
  char* out = static_cast<char*>(rq.output);
  const Wire plain(intra, within);
  auto scatter = [&](size_t s) {  // 1
    for (size_t c = s * per_slice; c < std::min(chunks, (s + 1) * per_slice); ++c)
      direct_reduce_step(intra, within, plain, shards, c, partial + c * shards.chunk * ws, Stage::Partial);
  };
  auto finish = [&](size_t s) {  // 3, 4
    size_t first, len;
    elements_of(s, first, len);
    const Term shard{partial + first * ws, Form::Partial};
    cx.ops->reduce_terms(cx.spec(rq), Stage::Final, out + (shards.seg.begin(local) + first) * es, &shard, 1, len);
    for (size_t c = s * per_slice; c < std::min(chunks, (s + 1) * per_slice); ++c) {
      size_t mine, mine_len;
      shards.piece(local, c, mine, mine_len);
      direct_gather_step(intra, plain, shards, c, out + mine * es, out);
    }
  };

  if (slices == 1) {
    scatter(0);
    reduce_across(0);
    finish(0);
    return;
  }
  InterNodeLane lane(inter, slices, reduce_across);
  try {
    for (size_t s = 0; s < slices; ++s) {
      scatter(s);
      lane.post(s);
    }
    for (size_t s = 0; s < slices; ++s) {
      lane.wait_done(s);
      finish(s);
    }
  } catch (const std::exception& e) {
    cx.abort(e.what());  // ends the lane's waits; the lane's own failure came first if any
    if (auto first = lane.failure()) std::rethrow_exception(first);
    throw;
  }
}

}  // namespace pycomm
