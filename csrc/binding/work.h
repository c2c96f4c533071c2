// What a pycomm collective hands back and what it runs: PycommWork, the c10d::Work (and
// its Future) that the engine completes, and Launch, the requests of one Work with the
// staging buffers and copy-backs around them.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

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

 private:
  void settle(c10::ivalue::Future& future) const;  // marks it as this work ended

  std::vector<at::Tensor> result_;
  std::mutex future_mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // guarded by future_mutex_
  bool done_ = false;                                // guarded by future_mutex_
  std::exception_ptr error_;                         // set before done_
  mutable std::mutex choices_mutex_;
  Communicator::Choices choices_;                    // guarded by choices_mutex_
};

// What one Work runs: requests in order, then copies out of staging buffers.
//
// CUDA tensors (stream semantics as ProcessGroupNCCL's, as far as a caller can tell): the
// requests wait for `ready`, recorded on the caller's current stream when the collective
// is issued; they run on the device ops' internal stream; the Work completes once the
// results, copy-backs included, are complete on the device, so Work.wait() (which waits
// for completion) orders every later use on any stream after them. `keep` holds every
// tensor involved until then.
struct Launch {
  std::vector<Request> requests;
  std::vector<at::Tensor> keep;               // every tensor a request points into
  std::vector<std::function<void()>> after;   // copy-backs, run after the last request
  std::vector<at::Tensor> result;             // the Work's result and future value
  at::Device device = at::kCPU;               // of every tensor in `keep` (bind_device())
  std::shared_ptr<c10::Event> ready;          // CUDA: the inputs are complete
  void* captured = nullptr;                   // CUDA: the stream a graph captures it on
  std::optional<Plan> first_plan;             // of requests[0], where made when issued

  at::Tensor in(const at::Tensor& t);         // dense read-only view (copied if strided)
  at::Tensor out(const at::Tensor& t);        // dense writable view, copied back if strided
  // A list as one dense input: its tensors' elements, concatenated.
  at::Tensor in_concat(const std::vector<at::Tensor>& parts);
  // A dense output whose consecutive pieces are copied into `parts` afterwards.
  at::Tensor out_split(const std::vector<at::Tensor>& parts, const at::Tensor& like);
  size_t bytes() const;                       // of the largest tensor involved

  // When the collective is issued, on the caller's thread: sets `device` (ValueError naming
  // `title` where the tensors in `keep` are on different devices) and, on CUDA, records
  // `ready` on the caller's current stream, or, where a graph captures that stream, sets
  // `captured` (capture_on_stream).
  void bind_device(const char* title);
  // Runs the copy-backs (`after`), after the last request; they are complete on the
  // device when it returns.
  void copy_back();
  // Where a CUDA graph captures the caller's current stream (set by bind_device): the
  // whole operation is enqueued on it (its request's `stream`), on the caller's thread,
  // nothing waited for on the host; only one request with no copy-back can be.
  void capture_on_stream(const char* title);
};

}  // namespace pycomm
