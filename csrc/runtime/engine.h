// The progress engine of a group. Collectives run one at a time, in issue order, on one
// worker thread, so the order of collectives is the same on every rank. Point-to-point
// operations are different: like Gloo's, a posted recv must not stop a later send (every
// rank posting irecv then send is a common pattern), so each (peer, direction) has a lane
// of its own that runs its operations in issue order, independently of the other lanes.
// A collective waits until every lane has drained; operations issued after it wait for it.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace pycomm {

class Engine {
 public:
  static constexpr int kOrdered = -1;  // the lane of collectives

  Engine();
  // Runs every task already submitted, then stops the threads.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // `task` must not throw; it reports its own outcome. `lane` >= 0 names a p2p lane.
  void submit(std::function<void()> task, int lane = kOrdered);
  // Runs an ordered `task` on the calling thread and returns true if nothing is queued or
  // running (a blocking call then costs no thread hand-off; the order is the same as
  // submitting it); else returns false without running it. Exceptions from `task`
  // propagate to the caller.
  bool try_run(const std::function<void()>& task);

 private:
  struct Item {
    std::function<void()> task;
    int lane;
  };
  struct Lane {
    std::deque<std::function<void()>> queue;
    std::thread thread;
  };
  void run();
  void run_lane(Lane* lane);
  bool on_engine_thread() const;

  std::mutex mutex_;
  std::condition_variable changed_;   // any state below changed
  std::deque<Item> queue_;            // not yet started, in issue order
  std::map<int, std::unique_ptr<Lane>> lanes_;
  int lane_tasks_ = 0;                // handed to lanes and not finished
  bool busy_ = false;                 // an ordered task is running (worker or inline)
  bool stopping_ = false;
  std::thread worker_;                // started last: every member above exists
};

}  // namespace pycomm
