// The helper thread of the hierarchical collectives (across_nodes.h).
#include "algorithms/across_nodes.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/dispatch.h"
#include "core/error.h"

namespace pycomm {
namespace {

// The inter-node phases of posted slices, in order, on a helper thread.
class InterNodeLane {
 public:
  InterNodeLane(const Context& cx, size_t slices, const std::function<void(size_t)>& across)
      : cx_(cx), slices_(slices), across_(across), thread_([this] { main(); }) {}
  ~InterNodeLane() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      posted_ = slices_;  // a lane waiting for work ends; one in a transfer ends by abort
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(size_t slice) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      posted_ = slice + 1;
    }
    cv_.notify_all();
  }
  // Blocks until `slice` is done across nodes; rethrows the lane's failure.
  void wait_done(size_t slice) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, cx_.deadline.at, [&] { return done_ > slice || failure_; }))
      fail(ErrorKind::Timeout, "pycomm: timed out waiting for the inter-node phase of slice " + std::to_string(slice));
    if (failure_) std::rethrow_exception(failure_);
  }
  std::exception_ptr failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }

 private:
  void main() {
    try {
      for (size_t s = 0; s < slices_; ++s) {
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return posted_ > s; });
          if (stop_) return;
        }
        across_(s);
        {
          std::lock_guard<std::mutex> lock(mu_);
          done_ = s + 1;
        }
        cv_.notify_all();
      }
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        failure_ = std::current_exception();
      }
      cv_.notify_all();
      cx_.abort(e.what());
    }
  }

  const Context& cx_;
  const size_t slices_;
  const std::function<void(size_t)>& across_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t posted_ = 0, done_ = 0;
  bool stop_ = false;
  std::exception_ptr failure_;
  std::thread thread_;  // last: starts after every other member is ready
};

}  // namespace

TwoLevel two_level(const Context& cx) {
  const Topology& topo = *cx.topology;
  const int me = cx.group_rank(cx.rank);
  const std::vector<int>& node = topo.nodes[topo.node_of[me]];
  const size_t local = std::find(node.begin(), node.end(), me) - node.begin();
  std::vector<int> column;
  for (const auto& n : topo.nodes) column.push_back(n[local]);
  return {cx.team(node), cx.team(column)};
}

Request across_partials(const Request& rq) {
  Request across = rq;
  across.dtype = accumulation_type(rq.dtype);
  const ReduceKind k = rq.reduction.kind;
  across.reduction = Reduction{k == ReduceKind::Avg || k == ReduceKind::PremulSum ? ReduceKind::Sum : k, 1.0};
  return across;
}

void run_across_nodes(const Context& cx, size_t slices, const std::function<void(size_t)>& before,
                      const std::function<void(size_t)>& across, const std::function<void(size_t)>& after) {
  if (slices == 1) {
    before(0);
    across(0);
    after(0);
    return;
  }
  InterNodeLane lane(cx, slices, across);
  try {
    for (size_t s = 0; s < slices; ++s) {
      before(s);
      lane.post(s);
    }
    for (size_t s = 0; s < slices; ++s) {
      lane.wait_done(s);
      after(s);
    }
  } catch (const std::exception& e) {
    cx.abort(e.what());  // ends the lane's waits; the lane's own failure came first if any
    if (auto first = lane.failure()) std::rethrow_exception(first);
    throw;
  }
}

}  // namespace pycomm
