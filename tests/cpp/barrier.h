// A reusable barrier for the threads that play ranks in the C++ tests.
#pragma once

#include <condition_variable>
#include <mutex>

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  // Returns once `n` threads have called it; true in the thread that came last (which
  // may look at a state all the others are waiting in before the next wait releases them).
  bool wait() {
    std::unique_lock<std::mutex> lk(mu_);
    const int gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return true;
    }
    cv_.wait(lk, [&] { return gen_ != gen; });
    return false;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, count_ = 0, gen_ = 0;
};
