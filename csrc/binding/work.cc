#include "binding/work.h"

#include <ATen/core/ivalue.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "runtime/device_runtime.h"

namespace pycomm {
namespace {

// The stream the calling thread enqueues work on for `device` (CUDA), through torch's
// device-generic interface, so that this file needs no CUDA header.
c10::Stream current_stream(const at::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

}  // namespace

PycommWork::PycommWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> result)
    : Work(rank, type, title), result_(std::move(result)) {}

Communicator::Choices PycommWork::choices() const {
  std::lock_guard<std::mutex> lock(choices_mutex_);
  return choices_;
}

void PycommWork::set_choices(Communicator::Choices c) {
  std::lock_guard<std::mutex> lock(choices_mutex_);
  choices_ = c;
}

int PycommWork::sourceRank() const {
  TORCH_CHECK_VALUE(source >= 0, "pycomm: source_rank() is known only for a completed recv from any source");
  return source;
}

void PycommWork::settle(c10::ivalue::Future& future) const {
  if (error_) future.setError(error_);
  else future.markCompleted(c10::IValue(result_));
}

c10::intrusive_ptr<c10::ivalue::Future> PycommWork::getFuture() {
  std::lock_guard<std::mutex> lock(future_mutex_);
  if (!future_) {
    static const auto type = c10::ListType::create(c10::TensorType::get());
    if (end_) {
      // Device-aware, as ProcessGroupNCCL's: completed on this thread's current stream once
      // that stream waits for the operation, its users' streams wait for it in turn.
      end_->block(current_stream(end_->device()));
      future_ = c10::make_intrusive<c10::ivalue::Future>(type, std::vector<c10::Device>{end_->device()});
    } else {
      future_ = c10::make_intrusive<c10::ivalue::Future>(type);
    }
    if (done_) settle(*future_);
  }
  return future_;
}

void PycommWork::enqueued_on_stream(const at::Device& device) {
  std::lock_guard<std::mutex> lock(future_mutex_);
  if (error_) return;  // it failed before anything was enqueued: wait() raises
  end_ = std::make_shared<c10::Event>(device.type());
  end_->record(current_stream(device));
}

bool PycommWork::isCompleted() {
  std::shared_ptr<c10::Event> end;
  {
    std::lock_guard<std::mutex> lock(future_mutex_);
    end = end_;
  }
  return Work::isCompleted() && (!end || end->query());
}

void PycommWork::synchronize() {
  std::lock_guard<std::mutex> lock(future_mutex_);
  if (end_) end_->block(current_stream(end_->device()));
}

// The future first: a caller woken by wait() may read get_future().value() at once.
void PycommWork::complete(std::exception_ptr error) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(future_mutex_);
    error_ = error;
    done_ = true;
    future = future_;
  }
  if (future) settle(*future);  // outside the lock: callbacks may run here
  finish(error);
}

at::Tensor Launch::in(const at::Tensor& t) {
  keep.push_back(t.contiguous());
  return keep.back();
}

size_t Launch::bytes() const {
  size_t most = 0;
  for (const auto& t : keep) most = std::max(most, static_cast<size_t>(t.nbytes()));
  return most;
}

at::Tensor Launch::out(const at::Tensor& t) {
  if (t.is_contiguous()) {
    keep.push_back(t);
    return t;
  }
  at::Tensor dense = t.contiguous();
  keep.push_back(dense);
  after.push_back([t, dense]() mutable { t.copy_(dense); });
  return dense;
}

at::Tensor Launch::in_concat(const std::vector<at::Tensor>& parts) {
  std::vector<at::Tensor> flat;
  for (const auto& t : parts) flat.push_back(t.reshape(-1));
  return in(at::cat(flat));
}

at::Tensor Launch::out_split(const std::vector<at::Tensor>& parts, const at::Tensor& like) {
  int64_t total = 0;
  for (const auto& t : parts) total += t.numel();
  at::Tensor flat = at::empty({total}, like.options().memory_format(c10::MemoryFormat::Contiguous));
  keep.push_back(flat);
  after.push_back([parts, flat]() mutable {
    int64_t off = 0;
    for (auto& t : parts) {
      t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  });
  return flat;
}

void Launch::bind_device(const char* title) {
  for (const at::Tensor& t : keep) {
    if (&t == &keep.front()) device = t.device();
    TORCH_CHECK_VALUE(t.device() == device, "pycomm: ", title, ": tensors on different devices (", device, " and ",
                      t.device(), ")");
  }
}

void Launch::order_on_device(const char* title, bool team_runs_it) {
  if (!device.is_cuda() || ready || on_stream) return;
  void* stream = current_stream(device).native_handle();
  captured = has_device_runtime() && device_runtime().capturing(device.index(), stream);
  const bool single = requests.size() == 1 && after.empty();
  TORCH_CHECK_VALUE(!captured || single, "pycomm: ", title,
                    " cannot be captured in a CUDA graph: only a single all-reduce of a dense tensor can");
  if (captured || (team_runs_it && single)) on_stream = requests.front().stream = stream;
  else host_driven();
}

void Launch::host_driven() {
  if (on_stream) on_stream = requests.front().stream = nullptr;
  ready = std::make_shared<c10::Event>(device.type());
  ready->record(current_stream(device));
}

void Launch::copy_back() {
  for (auto& copy : after) copy();
  // Copy-backs into CUDA tensors ran on this thread's current stream: complete them.
  if (!after.empty())
    for (const at::Tensor& t : result)
      if (t.is_cuda()) {
        current_stream(t.device()).synchronize();
        break;
      }
}

}  // namespace pycomm
