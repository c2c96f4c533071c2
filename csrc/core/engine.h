// The progress engine of a group: one worker thread that runs submitted tasks one at a
// time, in submission order. The order of operations on a group is therefore the order in
// which the caller issued them, on every rank, whatever thread completes them.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace pycomm {

class Engine {
 public:
  Engine();
  // Runs every task already submitted, then stops the worker.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // `task` must not throw; it reports its own outcome.
  void submit(std::function<void()> task);
  // Runs `task` on the calling thread if nothing is queued or running (a blocking call
  // then costs no thread hand-off), else queues it; the order is the same either way.
  void run_or_submit(std::function<void()> task);
  bool on_worker_thread() const { return std::this_thread::get_id() == worker_.get_id(); }

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  bool busy_ = false;  // a task is running, on the worker or inline on a caller
  std::thread worker_;
};

}  // namespace pycomm
