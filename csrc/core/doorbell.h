// Futex waits on 32-bit words, process-local or in shared memory, and the doorbell built
// on them: how a thread waiting for a frame on any of several channels (a recv from any
// source) sleeps until one arrives, instead of polling every channel.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace pycomm {

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be plain words");

// Sleeps while `*word` == `seen`, at most `slice`; spurious returns are the caller's to
// handle. Not FUTEX_PRIVATE: the word may be shared between processes.
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::milliseconds slice) {
  const long ms = std::max<long>(0, static_cast<long>(slice.count()));
  timespec ts{static_cast<time_t>(ms / 1000), (ms % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}
inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// One receiving rank's doorbell: whoever makes a frame available to it (a sender on its
// host through shared memory, its TCP I/O thread, a recv that moved a frame aside) rings
// it after the frame is visible; a waiter arms it, looks at every channel, and sleeps only
// while nothing rang since it armed. Dekker's ordering, as the shm rings' `sleeping` flags:
// the ringer publishes then fences then reads `armed`; the waiter sets `armed` then fences
// then looks, so either the waiter sees the frame or the ringer sees the waiter. Lives in
// the rank's shared-memory segment when it has peers on its host, else in its process.
struct alignas(64) DoorbellWord {
  std::atomic<uint32_t> rings{0};
  std::atomic<uint32_t> armed{0};  // waiters between arm() and disarm()
};

class Doorbell {
 public:
  explicit Doorbell(DoorbellWord* word = nullptr) : w_(word) {}
  explicit operator bool() const { return w_ != nullptr; }
  // After a frame became visible to the doorbell's owner; costs a fence and a load when
  // nobody waits.
  void ring() const {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    ring_after_fence();
  }
  // ring() for a caller that has just fenced (seq_cst) after publishing the frame.
  void ring_after_fence() const {
    if (!w_ || w_->armed.load(std::memory_order_relaxed) == 0) return;
    w_->rings.fetch_add(1, std::memory_order_release);
    futex_wake_all(&w_->rings);
  }

  // Whether a waiter holds the doorbell armed now: a transport that only pushes arrivals
  // to the doorbell on request asks this.
  bool waiting() const { return w_ && w_->armed.load(std::memory_order_relaxed) > 0; }

  // A waiter's hold on the doorbell, from before it looks at the channels until it is
  // done with them: wait() sleeps unless the doorbell rang since.
  class Armed {
   public:
    explicit Armed(const Doorbell& bell) : w_(bell.w_) {
      w_->armed.fetch_add(1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      seen_ = w_->rings.load(std::memory_order_acquire);
    }
    ~Armed() { w_->armed.fetch_sub(1, std::memory_order_relaxed); }
    Armed(const Armed&) = delete;
    Armed& operator=(const Armed&) = delete;
    // Sleeps at most `slice` unless the doorbell rang since this was armed.
    void wait(std::chrono::milliseconds slice) const { futex_wait(&w_->rings, seen_, slice); }

   private:
    DoorbellWord* w_;
    uint32_t seen_;
  };

 private:
  DoorbellWord* w_;
};

}  // namespace pycomm
