// What a pycomm collective hands back and what it runs: PycommWork, the c10d::Work (and
// its Future) that the engine completes, and Launch, the requests of one Work with the
// staging buffers and copy-backs around them.
#pragma once

#include <c10/core/Event.h>

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "core/request.h"
#include "runtime/communicator.h"
#include "runtime/plan.h"

namespace pycomm {

class PycommWork final : public c10d::Work {
 public:
  PycommWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> result);
  std::vector<at::Tensor> result() override { return result_; }
  // Created on first use: most callers only wait(), and a future costs allocations and a
  // traversal of the result on every completion.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // Completes the work (and its future, if any) with success or `error`; called once, by
  // the engine.
  void complete(std::exception_ptr error);
  // What runs the work's (first) operation: planned at launch, before the Work is
  // returned, and replaced by what ran once it has run (a collective on a CUDA device's
  // memory may learn its device team only then). Any thread.
  Communicator::Choices choices() const;
  void set_choices(Communicator::Choices c);
  // A recv from any source: the rank it received from, written before complete().
  int source = -1;
  int sourceRank() const override;

  // An operation enqueued on the caller's current stream of `device` (Launch::on_stream),
  // after complete(): from here on, as ProcessGroupNCCL's, wait() and synchronize() make
  // the caller's current stream wait for the operation and return (c10d::Work::wait calls
  // synchronize() once the work is complete on the host), is_completed() asks the device,
  // and the future's value is ready on the device for its users' streams.
  void enqueued_on_stream(const at::Device& device);
  bool isCompleted() override;
  void synchronize() override;

 private:
  void settle(c10::ivalue::Future& future) const;  // marks it as this work ended

  std::vector<at::Tensor> result_;
  std::mutex future_mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // guarded by future_mutex_
  bool done_ = false;                                // guarded by future_mutex_
  std::exception_ptr error_;                         // set before done_
  std::shared_ptr<c10::Event> end_;                  // on the caller's stream, after the operation
  mutable std::mutex choices_mutex_;
  Communicator::Choices choices_;                    // guarded by choices_mutex_
};

// What one Work runs: requests in order, then copies out of staging buffers.
//
// CUDA tensors: an all-reduce that the device's team runs, and any operation a CUDA graph
// captures, is enqueued on the caller's current stream (`on_stream`) by the calling thread,
// and its Work waits as ProcessGroupNCCL's do (PycommWork::enqueued_on_stream). The others
// are driven by the host: the requests wait for `ready`, recorded on the caller's current
// stream when the collective is issued; they run on the device ops' internal stream; the
// Work completes once the results, copy-backs included, are complete on the device, so
// Work.wait() (which waits for completion on the host) orders every later use on any
// stream after them. `keep` holds every tensor involved until then.
struct Launch {
  std::vector<Request> requests;
  std::vector<at::Tensor> keep;               // every tensor a request points into
  std::vector<std::function<void()>> after;   // copy-backs, run after the last request
  std::vector<at::Tensor> result;             // the Work's result and future value
  at::Device device = at::kCPU;               // of every tensor in `keep` (bind_device())
  std::shared_ptr<c10::Event> ready;          // CUDA, driven by the host: the inputs are complete
  void* on_stream = nullptr;                  // CUDA: the caller's stream it is enqueued on
  bool captured = false;                      // on_stream is being captured by a graph
  std::optional<Plan> first_plan;             // of requests[0], where made when issued

  at::Tensor in(const at::Tensor& t);         // dense read-only view (copied if strided)
  at::Tensor out(const at::Tensor& t);        // dense writable view, copied back if strided
  // A list as one dense input: its tensors' elements, concatenated.
  at::Tensor in_concat(const std::vector<at::Tensor>& parts);
  // A dense output whose consecutive pieces are copied into `parts` afterwards.
  at::Tensor out_split(const std::vector<at::Tensor>& parts, const at::Tensor& like);
  size_t bytes() const;                       // of the largest tensor involved

  // When the collective is issued, on the caller's thread: sets `device` (ValueError naming
  // `title` where the tensors in `keep` are on different devices).
  void bind_device(const char* title);
  // Then, on CUDA, on the caller's thread: where a graph captures the caller's current
  // stream, or `team_runs_it` (the device's team runs the first request), a single request
  // with no copy-back is enqueued on that stream (`on_stream`, the request's `stream`);
  // a captured operation that cannot be is a ValueError naming `title`. Otherwise, or
  // after host_driven(), `ready` is recorded on it. Once per launch.
  void order_on_device(const char* title, bool team_runs_it);
  void host_driven();
  // Runs the copy-backs (`after`), after the last request; they are complete on the
  // device when it returns.
  void copy_back();
};

}  // namespace pycomm
