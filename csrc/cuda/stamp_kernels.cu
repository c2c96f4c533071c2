// launch_write_words and launch_judge_stamps (stamp_kernels.h).
#include <climits>

#include "cuda/cuda_check.h"
#include "cuda/stamp_kernels.h"

namespace pycomm {
namespace {

struct Words {
  int64_t v[kMaxStampWords];
};

__global__ void write_words_kernel(int64_t* dst, Words words, int n) {
  if (static_cast<int>(threadIdx.x) < n) dst[threadIdx.x] = words.v[threadIdx.x];
}

// judge_stamps (device_runtime.cc) by one block: the first difference in row order is the
// smallest index p * words + f at which row p differs, found by atomicMin. The verdict's
// other words are written, and made visible to the host, before its first.
__global__ void judge_kernel(StampTable t, int64_t* verdict) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) first = ULLONG_MAX;
  __syncthreads();
  const size_t total = t.count * static_cast<size_t>(t.words);
  for (size_t i = threadIdx.x; i < total; i += blockDim.x) {
    const size_t p = i / t.words, f = i % t.words;
    if (static_cast<int>(p) != t.skip && t.rows[p * t.row_stride + f] != t.mine[f])
      atomicMin(&first, static_cast<unsigned long long>(i));
  }
  __syncthreads();
  if (threadIdx.x != 0 || first == ULLONG_MAX || verdict[0] != 0) return;
  const size_t p = first / t.words, f = first % t.words;
  const int64_t found[kVerdictWords] = {
      1,        static_cast<int64_t>(p), static_cast<int64_t>(f), t.rows[p * t.row_stride + f], t.mine[f], t.mine[1],
      t.mine[2]};
  for (int w = 1; w < kVerdictWords; ++w) verdict[w] = found[w];
  __threadfence_system();
  verdict[0] = found[0];
}

}  // namespace

void launch_write_words(int64_t* dst, const int64_t* words, int n, const KernelTarget& target) {
  if (n < 1 || n > kMaxStampWords)
    fail(ErrorKind::InvalidArgument, "pycomm: a stamp holds 1 to " + std::to_string(kMaxStampWords) + " words");
  Words w{};
  for (int i = 0; i < n; ++i) w.v[i] = words[i];
  write_words_kernel<<<1, kMaxStampWords, 0, target.stream>>>(dst, w, n);
  cuda_check(cudaGetLastError(), "stamp kernel launch");
}

void launch_judge_stamps(const StampTable& table, int64_t* verdict, const KernelTarget& target) {
  judge_kernel<<<1, 256, 0, target.stream>>>(table, verdict);
  cuda_check(cudaGetLastError(), "stamp kernel launch");
}

}  // namespace pycomm
