#include "binding/backend.h"
#include "binding/tables.h"

namespace pycomm {

CallOptions ProcessGroupPycomm::call_options(Collective c, const std::string& algorithm, const std::string& compression,
                                             const std::string& determinism) const {
  CallOptions o = config(name_of(c)).options_for(c);
  guard([&] {
    if (!algorithm.empty()) o.algorithm = parse<Algorithm>(algorithm);
    if (!compression.empty()) o.compression = parse<Compression>(compression);
    if (!determinism.empty()) o.determinism = parse<Determinism>(determinism);
  });
  return o;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::all_reduce_with(at::Tensor& tensor, const c10d::ReduceOp& op,
                                                                   const CallOptions& options, bool blocking) {
  Launch l;
  add_allreduce(l, tensor, op, c10d::kUnsetTimeout, options);
  l.result = {tensor};
  return launch_direct(c10d::OpType::ALLREDUCE, "pycomm:all_reduce", std::move(l), blocking);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce_scatter_with(at::Tensor& output, at::Tensor& input,
                                                                       const c10d::ReduceOp& op,
                                                                       const CallOptions& options, bool blocking) {
  Launch l;
  add_reduce_scatter(l, output, input, op, c10d::kUnsetTimeout, options);
  l.result = {output};
  return launch_direct(c10d::OpType::_REDUCE_SCATTER_BASE, "pycomm:reduce_scatter_tensor", std::move(l), blocking);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::all_gather_with(at::Tensor& output, at::Tensor& input,
                                                                   const CallOptions& options, bool blocking) {
  Launch l;
  add_allgather(l, output, input, c10d::kUnsetTimeout, options);
  l.result = {output};
  return launch_direct(c10d::OpType::_ALLGATHER_BASE, "pycomm:all_gather_into_tensor", std::move(l), blocking);
}

}  // namespace pycomm
