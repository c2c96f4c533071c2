#include "binding/backend.h"

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "binding/arguments.h"
#include "binding/store_adapter.h"
#include "binding/tables.h"

namespace pycomm {

ProcessGroupPycomm::ProcessGroupPycomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                       std::chrono::milliseconds timeout, const std::string& group_name, Config config)
    : Backend(rank, size), group_name_(group_name) {
  guard([&] {
    store_ = std::make_unique<TorchStore>(store);
    comm_ = std::make_unique<Communicator>(*store_, rank, size, group_name, timeout, std::move(config));
  });
  engine_ = std::make_unique<Engine>();
}

ProcessGroupPycomm::~ProcessGroupPycomm() { engine_.reset(); }

PycommProcessGroup::PycommProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                       const c10::intrusive_ptr<ProcessGroupPycomm>& backend,
                                       const std::vector<c10::Device>& devices)
    : ProcessGroup(store, rank, size) {
  for (const c10::Device& d : devices) setBackend(d.type(), BackendType::CUSTOM, backend);
  setDefaultBackend(BackendType::CUSTOM);
}

void ProcessGroupPycomm::setTimeout(std::chrono::milliseconds timeout) {
  engine_->submit([this, timeout] { comm_->set_timeout(timeout); });
}

std::string ProcessGroupPycomm::stats_json() const {
  TORCH_CHECK_VALUE(comm_, "pycomm: stats of a group that was shut down");
  return comm_->stats_json();
}

std::string ProcessGroupPycomm::flight_recorder_json() const {
  TORCH_CHECK_VALUE(comm_, "pycomm: flight recorder of a group that was shut down");
  return comm_->flight_recorder_json("requested");
}

std::string ProcessGroupPycomm::dump_flight_recorder(const std::string& path) const {
  TORCH_CHECK_VALUE(comm_, "pycomm: flight recorder of a group that was shut down");
  return guard([&] { return comm_->dump_flight_recorder("requested", path); });
}

void ProcessGroupPycomm::abort() {
  if (comm_) comm_->abort("pycomm: group aborted by the application");
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupPycomm::shrink(const std::vector<int64_t>& ranks_to_exclude,
                                                             int shrink_flags,
                                                             const c10::intrusive_ptr<Options>& opts_override) {
  TORCH_CHECK_VALUE(comm_, "pycomm: shrink of a group that was shut down");
  std::vector<bool> excluded(getSize(), false);
  for (int64_t r : ranks_to_exclude) {
    TORCH_CHECK_VALUE(r >= 0 && r < getSize(), "pycomm: shrink: rank ", r, " is not in this group of ", getSize());
    excluded[r] = true;
  }
  TORCH_CHECK_VALUE(!excluded[getRank()], "pycomm: shrink: rank ", getRank(),
                    " is excluded, so it must not call shrink");
  constexpr int kShrinkAbort = 0x01;  // torch.distributed.SHRINK_ABORT
  if (shrink_flags & kShrinkAbort) comm_->abort("pycomm: group aborted to shrink it");
  const int rank = static_cast<int>(std::count(excluded.begin(), excluded.begin() + getRank(), false));
  const int size = static_cast<int>(std::count(excluded.begin(), excluded.end(), false));
  const auto timeout = opts_override ? opts_override->timeout : comm_->timeout();
  // Every survivor of this instance counts its shrinks alike, so they meet under one prefix.
  const std::string prefix = comm_->key_prefix() + "/shrink/" + std::to_string(++shrinks_);
  // Each survivor publishes the ranks it excludes and reads the others': survivors that
  // name different ranks fail here, naming both lists, rather than in groups of different
  // sizes; one that never calls shrink (or died) is named when `timeout` ends the wait.
  const auto key = [&](int r) { return prefix + "/excluded/" + std::to_string(r); };
  std::string mine;
  std::vector<int> others;
  for (int r = 0; r < getSize(); ++r) {
    if (excluded[r]) mine += (mine.empty() ? "" : ",") + std::to_string(r);
    else if (r != getRank()) others.push_back(r);
  }
  std::vector<std::string> keys;
  for (int r : others) keys.push_back(key(r));
  guard([&] {
    store_->set(key(getRank()), mine);
    const std::vector<std::string> theirs = get_all(*store_, keys, Deadline::after(timeout), [&](size_t i) {
      return "pycomm: shrink of group '" + group_name_ + "': rank " + std::to_string(others[i]) +
             " did not call it (rank " + std::to_string(getRank()) + " waited for it)";
    });
    for (size_t i = 0; i < others.size(); ++i)
      if (theirs[i] != mine)
        fail(ErrorKind::InvalidArgument, "pycomm: shrink of group '" + group_name_ + "': rank " +
                                             std::to_string(others[i]) + " excludes ranks [" + theirs[i] +
                                             "] and rank " + std::to_string(getRank()) + " excludes [" + mine + "]");
  });
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_->torch_store());
  return c10::make_intrusive<ProcessGroupPycomm>(store, rank, size, timeout, group_name_ + ":shrunk", comm_->config());
}

// Runs what was submitted, then releases threads, sockets and shared memory now rather
// than when the last Python reference goes. The group cannot be used afterwards.
void ProcessGroupPycomm::shutdown() {
  engine_.reset();
  comm_.reset();
}

const Config& ProcessGroupPycomm::config(const char* title) const {
  TORCH_CHECK_VALUE(engine_ && comm_, "pycomm: ", title, " on a group that was shut down");
  return comm_->config();
}

Request ProcessGroupPycomm::request(Collective c, const at::Tensor& t, std::chrono::milliseconds timeout,
                                    const CallOptions* options) const {
  return tensor_request(c, t, timeout, options ? *options : config(name_of(c)).options_for(c));
}

void ProcessGroupPycomm::validate(Launch& l, const char* title) {
  TORCH_CHECK_VALUE(engine_ && comm_, "pycomm: ", title, " on a group that was shut down");
  l.bind_device(title);
  guard([&] {
    for (Request& rq : l.requests) comm_->validate(rq);
    // On CUDA the plan says whether the operation can be enqueued on the caller's stream.
    if (l.device.is_cuda() && !l.requests.empty() && !l.first_plan)
      l.first_plan = comm_->plan_before_running(l.requests.front());
  });
  l.order_on_device(title, l.first_plan && l.first_plan->variant == Variant::OneShotFlags);
}

std::optional<Communicator::Choices> ProcessGroupPycomm::run(Launch& l) {
  if (l.ready) l.ready->synchronize();
  std::optional<Communicator::Choices> first;
  for (const Request& rq : l.requests) {
    const Plan plan = comm_->execute(rq, first || !l.first_plan ? nullptr : &*l.first_plan);
    if (!first) first = Communicator::choices(rq, plan);
  }
  l.copy_back();
  return first;
}

void ProcessGroupPycomm::complete(PycommWork& work, Launch& l) {
  try {
    if (const auto ran = run(l)) work.set_choices(*ran);
    work.complete(nullptr);
  } catch (const Error& e) {
    work.complete(torch_exception(e));
  } catch (...) {
    work.complete(std::current_exception());
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::launch(c10d::OpType type, const char* title, Launch&& l,
                                                          bool blocking, int lane) {
  validate(l, title);
  const size_t bytes = l.bytes();
  auto work = c10::make_intrusive<PycommWork>(getRank(), type, title, l.result);
  if (!l.requests.empty()) {
    if (!l.first_plan) l.first_plan = comm_->plan_before_running(l.requests.front());
    work->set_choices(Communicator::choices(l.requests.front(), *l.first_plan));
  }
  for (Request& rq : l.requests) {
    if (rq.collective == Collective::Recv && rq.root == kAnySource) rq.source = &work->source;
    if (rq.collective == Collective::Recv && rq.root != kAnySource) comm_->post_recv(rq.root, rq.tag);
  }
  // Small operations run eagerly even when asynchronous: they are latency-bound, so a
  // hand-off to the worker thread would cost more than it could overlap. Run here, the
  // Launch needs no copy on the heap.
  // An operation on the caller's stream is enqueued by this thread, in order with the
  // group's others: only while none is pending. Else it is driven by the host, after
  // them, but a captured one cannot be (the worker thread cannot wait for inputs that a
  // graph only records).
  if (l.on_stream) {
    if (lane == Engine::kOrdered && engine_->try_run([&] { complete(*work, l); })) {
      work->enqueued_on_stream(l.device);
      return work;
    }
    TORCH_CHECK(!l.captured, "pycomm: ", title, " captured in a CUDA graph while the group's earlier operations ",
                "still run: wait for them before capturing");
    l.host_driven();
  }
  const bool eager = blocking || bytes <= config(title).eager_bytes;
  if (eager && lane == Engine::kOrdered && engine_->try_run([&] { complete(*work, l); })) return work;
  auto job = std::make_shared<Launch>(std::move(l));
  engine_->submit([this, work, job] { complete(*work, *job); }, lane);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::launch_direct(c10d::OpType type, const char* title, Launch&& l,
                                                                 bool blocking) {
  if (blocking) {
    validate(l, title);
    // A Work records its operation's profiler range (c10d::Work with a title); an
    // operation run here has no Work, so it records its own.
    if (guard([&] {
          return engine_->try_run([&] {
            RECORD_FUNCTION(title, std::vector<c10::IValue>());
            run(l);
          });
        }))
      return {};
  }
  return launch(type, title, std::move(l), blocking);
}

}  // namespace pycomm
