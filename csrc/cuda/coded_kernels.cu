// launch_coded (kernels.h): the codec's launcher, launch_coded_for (coded_kernels.cuh),
// each instantiated in a file of its own (coded_kernels_<codec>.cu).
#include "core/dispatch.h"
#include "cuda/kernels.h"

namespace pycomm {

void launch_coded(const ReduceSpec& spec, Stage stage, void* out, const Terms& t, const SegmentSlots& pairs,
                  const KernelTarget& target) {
  dispatch_codec(spec.codec, [&](auto code) {
    launch_coded_for<typename decltype(code)::type>(spec, stage, out, t, pairs, target);
  });
}

}  // namespace pycomm
