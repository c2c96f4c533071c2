// The steps of the layered path (pycomm/layered/), which runs pycomm's all-reduce,
// reduce-scatter and all-gather over a group whose backend is not pycomm (nccl, gloo,
// mpi, ...), that group only moving bytes. Each step is the native path's own definition,
// so both paths give the same bits:
//   LayeredConfig    the knobs a group's calls read, read once: the options a call runs
//                    with, by the native path's rules; the kernels; the ranks' hosts;
//   layered_plan     which layered algorithm runs it, in how many parts (runtime/layered_plan.h);
//   segment_begins   how a buffer splits over the ranks (Segments, core/segments.h);
//   fold             DeviceOps::reduce_terms on tensors, on their device;
//   fold_segments    DeviceOps::reduce_segments likewise: a codec's step over every segment;
//   write_stamp, judge_stamps  a call's stamps, written and compared on their device;
//   LayeredRecorder  the record of the operations, as a pycomm group keeps its own.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "binding/tables.h"
#include "core/config.h"
#include "device/device_ops.h"
#include "runtime/layered_plan.h"
#include "runtime/recorder.h"

namespace pycomm {

// What a call runs with, decided as a pycomm group decides: the per-call values where
// given (non-empty) over the group-wide knobs, the dtype and op checked, the codec dropped
// where it does not apply.
struct LayeredOptions {
  std::string codec;        // "none" when the call runs uncompressed
  int64_t block = 0;        // PYCOMM_COMPRESSION_BLOCK
  std::string determinism;  // "0", "1" or "exact"
  std::string algorithm;    // the requested family: "auto", "twoshot" (direct), "hierarchical", ...
};

// The environment as a group's layered calls read it: once, when the group's first
// layered call makes its record, so that no call reads it again.
class LayeredConfig {
 public:
  LayeredConfig();
  // The options of a call of `collective` ("allreduce", "reduce_scatter", "allgather") on
  // `dtype` with `op`, and `compression` and `determinism` as the direct API passes them.
  LayeredOptions options(const std::string& collective, at::ScalarType dtype, const c10d::ReduceOp& op,
                         const std::string& algorithm, const std::string& compression,
                         const std::string& determinism) const;
  // PYCOMM_KERNELS: "auto", "cuda" or "triton".
  std::string kernels() const;
  // Which host each of `keys` (one per rank, e.g. pycomm.host_key()'s) is on: ranks with
  // equal keys share a host, hosts numbered in order of first appearance; with
  // PYCOMM_RANKS_PER_NODE, rank r is on host r / that many, as a pycomm group counts nodes.
  std::vector<int> hosts_of(const std::vector<std::string>& keys) const;
  const Config& config() const { return config_; }

 private:
  Config config_;
};

// The plan of a layered call of `count` elements with `options`, over a mover whose ranks
// are on the hosts `host_of` (host indices in order of first appearance), on device
// memory or not; `within` and `across` the measured (latency_us, bytes_per_us) of the
// mover within a host (per rank) and of a link between hosts ((0, 0): the plan's
// default), `core_share` the share of a core each rank has (see MoverCosts);
// `pairwise_mover` and `oneshot_capacity`: see LayeredPlanInput.
LayeredPlan layered_plan(const std::string& collective, at::ScalarType dtype, int64_t count,
                         const LayeredOptions& options, const std::vector<int>& host_of,
                         std::pair<double, double> within, std::pair<double, double> across, double core_share,
                         bool device_memory, bool pairwise_mover, int64_t oneshot_capacity);

// (kind, factor) of `op` on `dtype` as the core reduces it (bool SUM is MAX, ...): kind is
// the core's name ("sum", "avg", "premul_sum", ...), factor PREMUL_SUM's (else 1).
std::tuple<std::string, double> reduction_of(const c10d::ReduceOp& op, at::ScalarType dtype);

// The first element of each of `parts` segments of `count` elements cut in whole units
// of `unit` (the codec block where whole blocks must stay together), and `count` last.
std::vector<int64_t> segment_begins(int64_t count, int64_t parts, int64_t unit);

// Bytes of `count` elements encoded with `codec` in blocks of `block`.
int64_t encoded_size(const std::string& codec, int64_t block, int64_t count);

// out = terms[0] (+) ... (+) terms[k-1] for `count` elements of `dtype`, each term in its
// form (Input: a contribution in `dtype`; Partial: the accumulation format; Encoded: the
// codec's bytes), reduced per `op` (AVG divides by world_size, exact mode's sum where
// `exact`), written as `stage` says: DeviceOps::reduce_terms, the function every native
// algorithm reduces with. Tensors are contiguous, on one device, of exactly the bytes
// their form needs. CPU tensors are reduced before it returns; CUDA tensors by a kernel
// enqueued on the current stream, not waited for.
void fold(at::Tensor& out, const std::vector<at::Tensor>& terms, const std::vector<Form>& forms, at::ScalarType dtype,
          int64_t count, const c10d::ReduceOp& op, int64_t world_size, bool exact, const std::string& codec,
          int64_t block, Stage stage);

// fold of each pair of segment s of `plain` (Segments(count, parts, unit) of its elements)
// and slot s of `slots` (bytes, slot s at s * slot_bytes), but `skip` (-1: none):
// SegmentSlots (device/device_ops.h). `stage` encodes each segment (contributions of
// `dtype`) into its slot (Encoded, FinalEncoded) or decodes each slot into its segment, in
// the stage's form (Final, Partial); a codec is needed. On CUDA tensors one kernel launch
// for every pair, enqueued as fold's.
void fold_segments(at::Tensor& plain, at::Tensor& slots, int64_t count, int64_t parts, int64_t unit, int64_t skip,
                   int64_t slot_bytes, at::ScalarType dtype, const c10d::ReduceOp& op, int64_t world_size, bool exact,
                   const std::string& codec, int64_t block, Stage stage);

// A call's stamp (int64 `words`) written into `dst` (int64, on any device; on CUDA by a
// kernel enqueued on the current stream, the words its arguments: nothing copied from the
// host).
void write_stamp(at::Tensor& dst, const std::vector<int64_t>& words);

// judge_stamps (runtime/device_runtime.h) of `rows` (int64, one stamp per row, the first
// mine.numel() words of each) against `mine`, row `skip` left out, into `verdict` (int64,
// kVerdictWords, on the host; page-locked where the stamps are on a CUDA device, which
// writes it from a kernel enqueued on the current stream).
void judge_stamps(const at::Tensor& rows, const at::Tensor& mine, int64_t skip, at::Tensor& verdict);

// What the record of every call of one kind says but its sequence number: made once per
// kind of call (LayeredRecorder::kind), so that a call's begin parses nothing.
struct LayeredKind {
  OpStamp stamp;  // its seq filled in at begin
  int64_t bytes = 0;
  int device = -1;
  std::string fallback;
};

// This rank's record of the layered operations on one group, kept by the native path's
// Recorder and knobs: the counters of pycomm.stats, the flight recorder (PYCOMM_FLIGHT_
// RECORDER operations, written to a file when one fails) and the INFO line of each
// operation (PYCOMM_DEBUG). Operations carry their plan's variant. Thread-safe:
// a group's calls may end on its lane while the caller reads.
class LayeredRecorder {
 public:
  LayeredRecorder(const std::string& group, int64_t rank, int64_t size, const std::string& mover,
                  const LayeredConfig& config);
  // The calls of `collective` on `count` elements of `dtype` (the call's tensor) with `op`,
  // `options` and `plan`: `bytes` as nccl-tests counts S, on CUDA device `device` or host
  // memory (-1).
  LayeredKind kind(const std::string& collective, at::ScalarType dtype, int64_t count, const c10d::ReduceOp& op,
                   const LayeredOptions& options, const LayeredPlan& plan, int64_t bytes, int64_t device) const;
  // Begins call `seq` of `kind`; returns its id.
  int64_t begin(const LayeredKind& kind, int64_t seq);
  void completed(int64_t id);
  // Ends operation `id` as failed with `error`; returns the flight recorder's file, or ""
  // where it keeps no operations.
  std::string failed(int64_t id, const std::string& error);
  std::string stats_json() const;
  std::string flight_recorder_json() const;
  // Writes the flight recorder to `path` (empty: this rank's file); returns the path.
  std::string dump_flight_recorder(const std::string& path) const;

 private:
  const Config config_;
  const Recorder::Who who_;
  const std::string mover_;
  Recorder recorder_;
  std::mutex mutex_;
  std::map<int64_t, LayeredKind> running_;  // for the INFO line
};

}  // namespace pycomm
