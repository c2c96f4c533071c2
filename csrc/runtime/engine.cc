#include "runtime/engine.h"

namespace pycomm {
namespace {
thread_local const Engine* current_engine = nullptr;  // the engine whose thread this is
}

Engine::Engine() : worker_([this] { run(); }) {}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();  // returns once every task has been run
  for (auto& [id, lane] : lanes_) lane->thread.join();
}

bool Engine::on_engine_thread() const { return current_engine == this; }

void Engine::submit(std::function<void()> task, int lane) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Item{std::move(task), lane});
  }
  changed_.notify_all();
}

bool Engine::try_run(const std::function<void()>& task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_ || !queue_.empty() || lane_tasks_ > 0 || on_engine_thread()) return false;
    busy_ = true;
  }
  // Only queued work waits for busy_ to clear; an idle worker needs no wake-up, and
  // waking it on every inline call costs a futex and a context switch.
  struct Done {
    Engine* e;
    ~Done() {
      bool queued;
      {
        std::lock_guard<std::mutex> lock(e->mutex_);
        e->busy_ = false;
        queued = !e->queue_.empty();
      }
      if (queued) e->changed_.notify_all();
    }
  } done{this};
  task();
  return true;
}

void Engine::run() {
  current_engine = this;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] {
      if (busy_) return false;
      if (queue_.empty()) return stopping_ && lane_tasks_ == 0;
      return queue_.front().lane != kOrdered || lane_tasks_ == 0;
    });
    if (queue_.empty()) break;  // stopping, and everything submitted has run
    Item item = std::move(queue_.front());
    queue_.pop_front();
    if (item.lane != kOrdered) {
      auto& lane = lanes_[item.lane];
      if (!lane) {
        lane = std::make_unique<Lane>();
        lane->thread = std::thread([this, l = lane.get()] { run_lane(l); });
      }
      lane->queue.push_back(std::move(item.task));
      ++lane_tasks_;
      changed_.notify_all();
      continue;
    }
    busy_ = true;
    lock.unlock();
    item.task();
    lock.lock();
    busy_ = false;
  }
  stopping_ = true;  // lanes exit once empty
  changed_.notify_all();
}

void Engine::run_lane(Lane* lane) {
  current_engine = this;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return !lane->queue.empty() || (stopping_ && lane_tasks_ == 0); });
    if (lane->queue.empty()) return;
    auto task = std::move(lane->queue.front());
    lane->queue.pop_front();
    lock.unlock();
    task();
    lock.lock();
    --lane_tasks_;
    changed_.notify_all();
  }
}

}  // namespace pycomm
