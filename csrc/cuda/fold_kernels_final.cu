// Uncoded folds at Stage::Final: results finalized, stored as the data type (fold_kernels.cuh).
#include "cuda/fold_kernels.cuh"

namespace pycomm {

template void launch_fold_for<true>(const ReduceSpec&, void*, const Terms&, size_t, const KernelTarget&);

}  // namespace pycomm
