// The steps of the layered path (pycomm/layered.py), which runs pycomm's all-reduce,
// reduce-scatter and all-gather over a group whose backend is not pycomm (nccl, gloo,
// mpi, ...), that group only moving bytes. Each step is the native path's own definition,
// so both paths give the same bits:
//   layered_options  the options a call runs with, by the native path's rules;
//   segment_begins   how a buffer splits over the ranks (Segments, algorithm.h);
//   fold             DeviceOps::reduce_terms on tensors, on their device.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <tuple>
#include <vector>

#include "device/device_ops.h"

namespace pycomm {

// What a call runs with, decided as a pycomm group decides: the per-call values where
// given (non-empty) over the group-wide knobs, the dtype and op checked, the codec dropped
// where it does not apply.
struct LayeredOptions {
  std::string codec;        // "none" when the call runs uncompressed
  int64_t block = 0;        // PYCOMM_COMPRESSION_BLOCK
  std::string determinism;  // "0", "1" or "exact"
  int log_level = 0;        // PYCOMM_DEBUG: 0 WARN, 1 INFO, 2 TRACE
};
// The options of a call of `collective` ("allreduce", "reduce_scatter", "allgather") on
// `dtype` with `op`, and `compression` and `determinism` as the direct API passes them.
LayeredOptions layered_options(const std::string& collective, at::ScalarType dtype, const c10d::ReduceOp& op,
                               const std::string& compression, const std::string& determinism);

// PYCOMM_KERNELS: "auto", "cuda" or "triton".
std::string kernel_choice();

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
void fold(at::Tensor& out, const std::vector<at::Tensor>& terms, const std::vector<Form>& forms,
          at::ScalarType dtype, int64_t count, const c10d::ReduceOp& op, int64_t world_size, bool exact,
          const std::string& codec, int64_t block, Stage stage);

}  // namespace pycomm
