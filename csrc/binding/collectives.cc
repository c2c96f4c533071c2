#include <c10/util/Exception.h>

#include "binding/arguments.h"
#include "binding/backend.h"
#include "binding/sparse_allreduce.h"
#include "binding/tables.h"

namespace pycomm {
namespace {

// Sends to a peer and receives from it are separate lanes: they use opposite directions
// of the pair's channel and must not wait for each other. Receives from any source have
// a lane of their own, after every peer's two.
int p2p_lane(int peer, bool send, int size) { return peer == kAnySource ? 2 * size : 2 * peer + (send ? 1 : 0); }

// A coalesced call's Launch (`op` names it in errors): a request per (output, input) pair,
// each added by `add`; its result is the outputs.
template <class Add>
Launch coalesced_launch(const char* op, const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                        Add add) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "pycomm: ", op, ": ", outputs.size(), " outputs for ",
                    inputs.size(), " inputs");
  Launch l;
  for (size_t i = 0; i < inputs.size(); ++i) add(l, outputs[i], inputs[i]);
  l.result = outputs;
  return l;
}

}  // namespace

void ProcessGroupPycomm::add_allreduce(Launch& l, const at::Tensor& t, const c10d::ReduceOp& op,
                                       std::chrono::milliseconds timeout, const CallOptions& options) {
  check_tensor(t, "allreduce");
  at::Tensor buf = l.out(t);
  Request rq = request(Collective::AllReduce, t, timeout, &options);
  rq.reduction = to_core(op);
  rq.input = rq.output = buf.data_ptr();
  rq.count = buf.numel();
  l.requests.push_back(rq);
}

void ProcessGroupPycomm::add_reduce_scatter(Launch& l, const at::Tensor& out, const at::Tensor& in,
                                            const c10d::ReduceOp& op, std::chrono::milliseconds timeout,
                                            const CallOptions& options) {
  check_same(out, in, "reduce_scatter");
  TORCH_CHECK_VALUE(in.numel() == out.numel() * getSize(), "pycomm: reduce_scatter: input has ", in.numel(),
                    " elements, expected output elements x world size = ", out.numel() * getSize());
  Request rq = request(Collective::ReduceScatter, out, timeout, &options);
  rq.reduction = to_core(op);
  rq.input = l.in(in).data_ptr();
  rq.output = l.out(out).data_ptr();
  rq.count = out.numel();
  l.requests.push_back(rq);
}

void ProcessGroupPycomm::add_allgather(Launch& l, const at::Tensor& out, const at::Tensor& in,
                                       std::chrono::milliseconds timeout, const CallOptions& options) {
  check_same(out, in, "allgather");
  TORCH_CHECK_VALUE(out.numel() == in.numel() * getSize(), "pycomm: allgather: output has ", out.numel(),
                    " elements, expected input elements x world size = ", in.numel() * getSize());
  Request rq = request(Collective::AllGather, in, timeout, &options);
  // Order matters for in-place use (input a view of the output): read before write.
  rq.input = l.in(in).data_ptr();
  rq.output = l.out(out).data_ptr();
  rq.count = in.numel();
  l.requests.push_back(rq);
}

void ProcessGroupPycomm::add_allgather_list(Launch& l, const std::vector<at::Tensor>& outs, const at::Tensor& in,
                                            std::chrono::milliseconds timeout) {
  check_tensor(in, "allgather");
  check_list(outs, in, getSize(), "allgather");
  Request rq = request(Collective::AllGather, in, timeout);
  rq.input = l.in(in).data_ptr();
  rq.output = l.out_split(outs, in).data_ptr();
  rq.count = in.numel();
  l.requests.push_back(rq);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse)
    return sparse_allreduce(tensors[0], opts);
  Launch l;
  add_allreduce(l, single(tensors, "allreduce"), opts.reduceOp, opts.timeout,
                config("allreduce").options_for(Collective::AllReduce));
  l.result = tensors;
  return launch(c10d::OpType::ALLREDUCE, "pycomm:all_reduce", std::move(l), !opts.asyncOp);
}

at::Tensor ProcessGroupPycomm::gather_host(const at::Tensor& mine, std::chrono::milliseconds timeout) {
  const at::Tensor in = mine.contiguous();
  at::Tensor out = at::empty({getSize(), in.numel()}, in.options());
  Request rq = request(Collective::AllGather, in, timeout);
  rq.options.compression = Compression::None;  // indices and values travel exactly
  rq.input = in.data_ptr();
  rq.output = out.data_ptr();
  rq.count = in.numel();
  comm_->validate(rq);
  comm_->execute(rq);
  return out;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::sparse_allreduce(at::Tensor& tensor,
                                                                    const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM,
                    "pycomm: all-reduce of sparse tensors only works with ReduceOp.SUM");
  to_core(tensor.scalar_type());
  const bool exact = config("allreduce").options_for(Collective::AllReduce).determinism == Determinism::Exact;
  const std::chrono::milliseconds timeout = op_timeout(opts.timeout);
  Launch l;
  l.result = {tensor};
  // Its steps depend on what the first gathers: they run as one task, in issue order.
  l.after.push_back([this, tensor, exact, timeout]() mutable {
    tensor.copy_(
        sparse_sum(tensor, getSize(), exact, [&](const at::Tensor& mine) { return gather_host(mine, timeout); }));
  });
  return launch(c10d::OpType::ALLREDUCE, "pycomm:all_reduce_sparse", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
  Launch l;
  for (const auto& t : tensors)
    add_allreduce(l, t, opts.reduceOp, opts.timeout, config("allreduce").options_for(Collective::AllReduce));
  l.result = tensors;
  return launch(c10d::OpType::ALLREDUCE_COALESCED, "pycomm:all_reduce_coalesced", std::move(l), !opts.asyncOp);
}

Request ProcessGroupPycomm::rooted_in_place(Launch& l, Collective c, const at::Tensor& t, int64_t root,
                                            std::chrono::milliseconds timeout) {
  at::Tensor buf = l.out(t);
  Request rq = request(c, t, timeout);
  rq.input = rq.output = buf.data_ptr();
  rq.count = buf.numel();
  rq.root = static_cast<int>(root);
  return rq;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  Launch l;
  l.requests.push_back(
      rooted_in_place(l, Collective::Broadcast, single(tensors, "broadcast"), opts.rootRank, opts.timeout));
  l.result = tensors;
  return launch(c10d::OpType::BROADCAST, "pycomm:broadcast", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  Launch l;
  Request rq = rooted_in_place(l, Collective::Reduce, single(tensors, "reduce"), opts.rootRank, opts.timeout);
  rq.reduction = to_core(opts.reduceOp);
  l.requests.push_back(rq);
  l.result = tensors;
  return launch(c10d::OpType::REDUCE, "pycomm:reduce", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = single(inputs, "allgather");
  TORCH_CHECK_VALUE(outputs.size() == 1, "pycomm: allgather takes one output list, got ", outputs.size());
  Launch l;
  add_allgather_list(l, outputs[0], in, opts.timeout);
  l.result = outputs[0];
  return launch(c10d::OpType::ALLGATHER, "pycomm:all_gather", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  Launch l;
  add_allgather(l, output, input, opts.timeout, config("allgather").options_for(Collective::AllGather));
  l.result = {output};
  return launch(c10d::OpType::_ALLGATHER_BASE, "pycomm:_all_gather_base", std::move(l), !opts.asyncOp);
}

// torch's layout: outputs[r][i] receives rank r's inputs[i]. One all-gather of the
// concatenated inputs; rank r's block of the result is split into outputs[r].
c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                       std::vector<at::Tensor>& inputs,
                                                                       const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(!inputs.empty(), "pycomm: allgather_coalesced: no input tensors");
  TORCH_CHECK_VALUE(outputs.size() == static_cast<size_t>(getSize()), "pycomm: allgather_coalesced: expected ",
                    getSize(), " output lists (one per rank), got ", outputs.size());
  std::vector<at::Tensor> parts;  // rank-major: the order of the gathered buffer
  for (const auto& list : outputs) {
    TORCH_CHECK_VALUE(list.size() == inputs.size(), "pycomm: allgather_coalesced: every output list must hold ",
                      inputs.size(), " tensors (one per input), got ", list.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_same(list[i], inputs[0], "allgather_coalesced");
      check_same(inputs[i], inputs[0], "allgather_coalesced");
      TORCH_CHECK_VALUE(list[i].numel() == inputs[i].numel(), "pycomm: allgather_coalesced: output for input ", i,
                        " has ", list[i].numel(), " elements, the input ", inputs[i].numel());
      parts.push_back(list[i]);
    }
  }
  Launch l;
  const at::Tensor in = l.in_concat(inputs);
  Request rq = request(Collective::AllGather, in, opts.timeout);
  rq.input = in.data_ptr();
  rq.output = l.out_split(parts, in).data_ptr();
  rq.count = in.numel();
  l.requests.push_back(rq);
  l.result = parts;
  return launch(c10d::OpType::ALLGATHER_COALESCED, "pycomm:all_gather_coalesced", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                   std::vector<at::Tensor>& inputs,
                                                                                   const c10d::AllgatherOptions& opts) {
  const CallOptions options = config("allgather").options_for(Collective::AllGather);
  Launch pairs = coalesced_launch("allgather_into_tensor_coalesced", outputs, inputs,
                                  [&](Launch& l, const at::Tensor& out, const at::Tensor& in) {
                                    add_allgather(l, out, in, opts.timeout, options);
                                  });
  return launch(c10d::OpType::COALESCED, "pycomm:all_gather_into_tensor_coalesced", std::move(pairs), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::GatherOptions& opts) {
  const at::Tensor& in = single(inputs, "gather");
  const int root = static_cast<int>(opts.rootRank);
  Launch l;
  Request rq = request(Collective::Gather, in, opts.timeout);
  rq.root = root;
  rq.input = l.in(in).data_ptr();
  rq.count = in.numel();
  if (const auto* list = root_list(outputs, in, getRank() == root, getSize(), "gather", "output")) {
    rq.output = l.out_split(*list, in).data_ptr();
    l.result = *list;
  }
  l.requests.push_back(rq);
  return launch(c10d::OpType::GATHER, "pycomm:gather", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ScatterOptions& opts) {
  const at::Tensor& out = single(outputs, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  Launch l;
  Request rq = request(Collective::Scatter, out, opts.timeout);
  rq.root = root;
  rq.output = l.out(out).data_ptr();
  rq.count = out.numel();
  if (const auto* list = root_list(inputs, out, getRank() == root, getSize(), "scatter", "input"))
    rq.input = l.in_concat(*list).data_ptr();
  l.requests.push_back(rq);
  l.result = outputs;
  return launch(c10d::OpType::SCATTER, "pycomm:scatter", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = single(outputs, "reduce_scatter");
  TORCH_CHECK_VALUE(inputs.size() == 1, "pycomm: reduce_scatter takes one input list, got ", inputs.size());
  check_list(inputs[0], out, getSize(), "reduce_scatter");
  Launch l;
  add_reduce_scatter(l, out, l.in_concat(inputs[0]), opts.reduceOp, opts.timeout,
                     config("reduce_scatter").options_for(Collective::ReduceScatter));
  l.result = outputs;
  return launch(c10d::OpType::REDUCE_SCATTER, "pycomm:reduce_scatter", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  Launch l;
  add_reduce_scatter(l, output, input, opts.reduceOp, opts.timeout,
                     config("reduce_scatter").options_for(Collective::ReduceScatter));
  l.result = {output};
  return launch(c10d::OpType::_REDUCE_SCATTER_BASE, "pycomm:_reduce_scatter_base", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  const CallOptions options = config("reduce_scatter").options_for(Collective::ReduceScatter);
  Launch pairs = coalesced_launch("reduce_scatter_tensor_coalesced", outputs, inputs,
                                  [&](Launch& l, const at::Tensor& out, const at::Tensor& in) {
                                    add_reduce_scatter(l, out, in, opts.reduceOp, opts.timeout, options);
                                  });
  return launch(c10d::OpType::REDUCE_SCATTER, "pycomm:reduce_scatter_tensor_coalesced", std::move(pairs),
                !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                 std::vector<int64_t>& output_splits,
                                                                 std::vector<int64_t>& input_splits,
                                                                 const c10d::AllToAllOptions& opts) {
  check_same(output, input, "alltoall");
  const int n = getSize();
  // Splits count rows of dim 0; empty splits mean equal parts.
  const auto counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* which) {
    const int64_t rows = t.dim() ? t.size(0) : 1, row = rows ? t.numel() / rows : 0;
    std::vector<size_t> c(n);
    if (splits.empty()) {
      TORCH_CHECK_VALUE(rows % n == 0, "pycomm: alltoall: ", which, " has ", rows,
                        " rows, not divisible by world size ", n);
      for (auto& x : c) x = static_cast<size_t>(rows / n * row);
      return c;
    }
    TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == n, "pycomm: alltoall: ", which, " splits list ", splits.size(),
                      " sizes for ", n, " ranks");
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      TORCH_CHECK_VALUE(splits[i] >= 0, "pycomm: alltoall: negative split size");
      total += splits[i];
      c[i] = static_cast<size_t>(splits[i] * row);
    }
    TORCH_CHECK_VALUE(total == rows, "pycomm: alltoall: ", which, " splits sum to ", total, " rows but the tensor has ",
                      rows);
    return c;
  };
  Launch l;
  Request rq = request(Collective::AllToAll, input, opts.timeout);
  rq.send_counts = counts(input, input_splits, "input");
  rq.recv_counts = counts(output, output_splits, "output");
  rq.input = l.in(input).data_ptr();
  rq.output = l.out(output).data_ptr();
  rq.count = input.numel();
  l.requests.push_back(rq);
  l.result = {output};
  return launch(c10d::OpType::ALLTOALL_BASE, "pycomm:all_to_all_single", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  const size_t n = static_cast<size_t>(getSize());
  TORCH_CHECK_VALUE(outputs.size() == n && inputs.size() == n, "pycomm: alltoall: expected ", n,
                    " input and output tensors, got ", inputs.size(), " and ", outputs.size());
  Launch l;
  Request rq = request(Collective::AllToAll, inputs[0], opts.timeout);
  for (size_t i = 0; i < n; ++i) {
    check_same(inputs[i], inputs[0], "alltoall");
    check_same(outputs[i], inputs[0], "alltoall");
    rq.send_counts.push_back(inputs[i].numel());
    rq.recv_counts.push_back(outputs[i].numel());
  }
  rq.input = l.in_concat(inputs).data_ptr();
  rq.output = l.out_split(outputs, inputs[0]).data_ptr();
  l.requests.push_back(rq);
  l.result = outputs;
  return launch(c10d::OpType::ALLTOALL, "pycomm:all_to_all", std::move(l), !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::p2p(Collective c, std::vector<at::Tensor>& tensors, int peer,
                                                       int tag) {
  const bool sending = c == Collective::Send;
  const at::Tensor& t = single(tensors, name_of(c));
  Launch l;
  // A CUDA tensor is passed as collectives pass theirs; the plan moves its bytes (p2p-via-host).
  Request rq = request(c, t, c10d::kUnsetTimeout);
  rq.root = peer;
  rq.tag = tag;
  if (sending) rq.input = l.in(t).data_ptr();
  else rq.output = l.out(t).data_ptr();
  rq.count = t.numel();
  l.requests.push_back(rq);
  l.result = tensors;
  return launch(sending ? c10d::OpType::SEND : c10d::OpType::RECV, sending ? "pycomm:send" : "pycomm:recv",
                std::move(l), false, p2p_lane(peer, sending, getSize()));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  return p2p(Collective::Send, tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return p2p(Collective::Recv, tensors, src, tag);
}

// The first rank to send with `tag` is received from; Work.source_rank() names it.
c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return p2p(Collective::Recv, tensors, kAnySource, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::barrier(const c10d::BarrierOptions& opts) {
  Launch l;
  Request rq;
  rq.collective = Collective::Barrier;
  rq.dtype = DataType::UInt8;
  rq.options = config("barrier").options_for(Collective::Barrier);
  rq.timeout = op_timeout(opts.timeout);
  l.requests.push_back(rq);
  return launch(c10d::OpType::BARRIER, "pycomm:barrier", std::move(l), !opts.asyncOp);
}

}  // namespace pycomm
