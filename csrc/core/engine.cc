#include "core/engine.h"

namespace pycomm {

Engine::Engine() : worker_([this] { run(); }) {}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_one();
  worker_.join();
}

void Engine::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(task));
  }
  ready_.notify_one();
}

void Engine::run_or_submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_ || !queue_.empty() || on_worker_thread()) {
      queue_.push_back(std::move(task));
      ready_.notify_one();
      return;
    }
    busy_ = true;
  }
  task();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
  }
  ready_.notify_one();
}

void Engine::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [&] { return (stopping_ && !busy_) || (!queue_.empty() && !busy_); });
      if (queue_.empty()) return;  // stopping, and everything submitted has run
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    task();
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
  }
}

}  // namespace pycomm
