// launch_fold (kernels.h): the stage's launcher, launch_fold_for (fold_kernels.cuh), each
// instantiated in a file of its own (fold_kernels_final.cu, fold_kernels_partial.cu).
#include "cuda/kernels.h"

namespace pycomm {

void launch_fold(const ReduceSpec& spec, Stage stage, void* out, const Terms& t, size_t n, const KernelTarget& target) {
  if (stage == Stage::Final) launch_fold_for<true>(spec, out, t, n, target);
  else launch_fold_for<false>(spec, out, t, n, target);
}

}  // namespace pycomm
