// launch_reduce_terms (reduce_kernels.h): checks the request and hands it to the fold
// kernels of its kind (kernels.h).
//
// Bit-equality with the CPU: nvcc must not contract a * b + c into a fused multiply-add
// (-fmad=false, set by setup.py and the Makefile), and divisions are IEEE (no fast math).
#include <algorithm>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/kernels.h"
#include "cuda/reduce_kernels.h"

namespace pycomm {

int grid_for(size_t work_items, int multiprocessors) {
  const size_t blocks = (work_items + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(blocks, static_cast<size_t>(multiprocessors) * 16)));
}

namespace {

void check_codec_block(const ReduceSpec& spec) {
  if (spec.codec != Compression::None && spec.block > static_cast<size_t>(kMaxCodecBlock))
    fail(ErrorKind::InvalidArgument, "pycomm: CUDA codecs take blocks of at most 1024 elements");
}

}  // namespace

void launch_reduce_terms(const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k, size_t n,
                         const KernelTarget& target) {
  if (n == 0) return;
  if (k < 1 || k > kMaxDeviceTerms)
    fail(ErrorKind::InvalidArgument,
         "pycomm: a CUDA reduction takes 1 to 64 terms (ranks reducing at once), got " + std::to_string(k));
  check_codec_block(spec);
  Terms t{};
  t.k = k;
  for (int j = 0; j < k; ++j) t.data[j] = terms[j].data, t.form[j] = terms[j].form;
  if (spec.codec != Compression::None) launch_coded(spec, stage, out, t, SegmentSlots{Segments{n, 1, 1}}, target);
  else launch_fold(spec, stage, out, t, n, target);
  cuda_check(cudaGetLastError(), "reduction kernel launch");
}

void launch_reduce_segments(const ReduceSpec& spec, Stage stage, void* plain, void* slots, const SegmentSlots& pairs,
                            const KernelTarget& target) {
  if (spec.codec == Compression::None)
    fail(ErrorKind::InvalidArgument, "pycomm: a fold over segments is a codec's step: it needs a codec");
  if (pairs.segments.count == 0) return;
  if (pairs.segments.parts > 65535)
    fail(ErrorKind::InvalidArgument, "pycomm: a CUDA fold over segments takes at most 65535 of them");
  check_codec_block(spec);
  const bool encodes = pairs.encodes(stage);
  Terms t{};
  t.k = 1;
  t.data[0] = encodes ? plain : slots;
  t.form[0] = encodes ? Form::Input : Form::Encoded;
  launch_coded(spec, stage, encodes ? slots : plain, t, pairs, target);
  cuda_check(cudaGetLastError(), "reduction kernel launch");
}

}  // namespace pycomm
