// The folds with bf16 codes (coded_kernels.cuh).
#include "cuda/coded_kernels.cuh"

namespace pycomm {

template void launch_coded_for<CodeBf16>(const ReduceSpec&, Stage, void*, const Terms&, const SegmentSlots&,
                                         const KernelTarget&);

}  // namespace pycomm
