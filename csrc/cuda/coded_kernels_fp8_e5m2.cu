// The folds with fp8 (e5m2) codes (coded_kernels.cuh).
#include "cuda/coded_kernels.cuh"

namespace pycomm {

template void launch_coded_for<CodeFp8E5M2>(const ReduceSpec&, Stage, void*, const Terms&, const SegmentSlots&,
                                            const KernelTarget&);

}  // namespace pycomm
