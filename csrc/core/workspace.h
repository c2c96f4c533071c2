// Scratch memory for an operation, kept from one operation to the next.
//
// Large collectives need buffers as large as a tensor's shard; allocating them per call
// costs a fresh mapping whose pages are faulted in and cleared by the kernel every time,
// plus a pass to zero them. A Workspace keeps the largest buffer asked for. Its contents
// are not initialized. Contract: one operation at a time uses it (a communicator runs
// its operations one after the other), and within an operation only one user, the
// outermost algorithm: a pointer stays valid until the next get().
#pragma once

#include <cstddef>
#include <memory>

namespace pycomm {

class Workspace {
 public:
  char* get(size_t bytes) {
    if (bytes > capacity_) {
      buffer_.reset();  // release before allocating: never hold both
      buffer_.reset(new char[bytes]);
      capacity_ = bytes;
    }
    return buffer_.get();
  }

 private:
  std::unique_ptr<char[]> buffer_;
  size_t capacity_ = 0;
};

}  // namespace pycomm
