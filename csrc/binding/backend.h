// The `pycomm` c10d backend: validates torch arguments, turns them into core Requests,
// and runs them on the group's progress engine. Every collective goes through launch().
// ProcessGroupPycomm is defined in three files: backend.cc (the group's lifecycle and
// launch), collectives.cc (the c10d::Backend collectives and point-to-point) and
// direct_api.cc (the direct API).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "binding/store_adapter.h"
#include "binding/work.h"
#include "runtime/communicator.h"
#include "runtime/engine.h"

namespace pycomm {

class ProcessGroupPycomm final : public c10d::Backend {
 public:
  // `config`: the group's knobs (Config::from_env, with its own settings where it has any).
  ProcessGroupPycomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     std::chrono::milliseconds timeout, const std::string& group_name, Config config);
  ~ProcessGroupPycomm() override;

  const std::string getBackendName() const override { return "pycomm"; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void abort() override;
  void shutdown() override;
  // torch.distributed.shrink_group: the group of the ranks not excluded, renumbered in
  // rank order, on transports of the same kinds, built through this group's store under
  // keys of its own. Only those ranks call it, each with the same ranks; it needs nothing
  // of this group but its store, so a group that a dead peer poisoned shrinks too.
  // SHRINK_ABORT first aborts what runs here. Leaves this group as it was (torch destroys
  // it next, which releases what it holds of the excluded ranks). The new group has this
  // group's configuration.
  bool supportsShrinking() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
                                           const c10::intrusive_ptr<Options>& opts_override) override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // The direct API: the same collectives with per-call options ("" = the group's default);
  // `blocking` as for launch_direct().
  c10::intrusive_ptr<c10d::Work> all_reduce_with(at::Tensor& tensor, const c10d::ReduceOp& op,
                                                 const CallOptions& options, bool blocking);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_with(at::Tensor& output, at::Tensor& input, const c10d::ReduceOp& op,
                                                     const CallOptions& options, bool blocking);
  c10::intrusive_ptr<c10d::Work> all_gather_with(at::Tensor& output, at::Tensor& input, const CallOptions& options,
                                                 bool blocking);
  CallOptions call_options(Collective c, const std::string& algorithm, const std::string& compression,
                           const std::string& determinism) const;
  std::string describe_transports() const { return comm_->describe_transports(); }
  // pycomm.stats() and the flight recorder (JSON texts, see runtime/recorder.h).
  std::string stats_json() const;
  std::string flight_recorder_json() const;
  std::string dump_flight_recorder(const std::string& path) const;

 private:
  // The group's configuration; a ValueError naming `title` once the group was shut down
  // (every call reads it before anything else touches the communicator).
  const Config& config(const char* title) const;
  // A request of `c` on `t`'s dtype and device, with `options` (the direct API's) or, where
  // null, the group's defaults for `c`.
  Request request(Collective c, const at::Tensor& t, std::chrono::milliseconds timeout,
                  const CallOptions* options = nullptr) const;
  // A broadcast's or reduce's request, in place on `t` (copied back where it is strided).
  Request rooted_in_place(Launch& l, Collective c, const at::Tensor& t, int64_t root,
                          std::chrono::milliseconds timeout);
  void add_allreduce(Launch& l, const at::Tensor& t, const c10d::ReduceOp& op, std::chrono::milliseconds timeout,
                     const CallOptions& options);
  void add_reduce_scatter(Launch& l, const at::Tensor& out, const at::Tensor& in, const c10d::ReduceOp& op,
                          std::chrono::milliseconds timeout, const CallOptions& options);
  void add_allgather(Launch& l, const at::Tensor& out, const at::Tensor& in, std::chrono::milliseconds timeout,
                     const CallOptions& options);
  // Sparse (COO) SUM all-reduce, as Gloo serves it (sparse_sum): the result replaces the
  // input's indices and values on every rank.
  c10::intrusive_ptr<c10d::Work> sparse_allreduce(at::Tensor& tensor, const c10d::AllreduceOptions& opts);
  // Every rank's `mine` (host memory, equal sizes) as rows of one tensor; runs at once, on
  // the calling (engine) thread.
  at::Tensor gather_host(const at::Tensor& mine, std::chrono::milliseconds timeout);
  c10::intrusive_ptr<c10d::Work> p2p(Collective c, std::vector<at::Tensor>& tensors, int peer, int tag);
  void add_allgather_list(Launch& l, const std::vector<at::Tensor>& outs, const at::Tensor& in,
                          std::chrono::milliseconds timeout);
  // `blocking`: the caller waits right away (async_op=False), so the engine may run it
  // inline; so it may when the operation is small (PYCOMM_EAGER_BYTES): its Work then
  // comes back completed. `lane`: Engine::kOrdered for collectives, else the p2p lane (see p2p_lane()).
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, const char* title, Launch&& l, bool blocking = false,
                                        int lane = Engine::kOrdered);
  // The direct API's launch: a blocking call that finds the engine idle runs on the
  // calling thread and returns nullptr (done; an error raises), with no Work at all.
  c10::intrusive_ptr<c10d::Work> launch_direct(c10d::OpType type, const char* title, Launch&& l, bool blocking);
  void validate(Launch& l, const char* title);
  // Executes the requests, then the copy-backs; returns what ran the first request.
  std::optional<Communicator::Choices> run(Launch& l);
  // Runs `l` and completes `work` with its outcome.
  void complete(PycommWork& work, Launch& l);

  std::string group_name_;
  int shrinks_ = 0;                    // of this group: each one's keys are its own
  std::unique_ptr<TorchStore> store_;  // the communicator keeps using it (device set-up)
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Engine> engine_;  // declared last: drained and stopped before comm_ goes
};

// The group torch.distributed keeps for a group whose every device runs pycomm
// (init_process_group("pycomm")): torch's ProcessGroup with `backend` for each of
// `devices`, named "pycomm" where torch and DDP read a group's name
// (ProcessGroup::getBackendName(), DDP's logging data); torch's own group object for a
// plugin backend can only say "custom". Collectives dispatch as in any ProcessGroup.
class PycommProcessGroup final : public c10d::ProcessGroup {
 public:
  PycommProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     const c10::intrusive_ptr<ProcessGroupPycomm>& backend, const std::vector<c10::Device>& devices);
  const std::string getBackendName() const override { return "pycomm"; }
};

}  // namespace pycomm
