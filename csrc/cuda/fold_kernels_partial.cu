// Uncoded folds at any other stage: results in the accumulation format (fold_kernels.cuh).
#include "cuda/fold_kernels.cuh"

namespace pycomm {

template void launch_fold_for<false>(const ReduceSpec&, void*, const Terms&, size_t, const KernelTarget&);

}  // namespace pycomm
