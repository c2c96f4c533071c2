// Scratch memory for an operation, kept from one operation to the next.
//
// Large collectives need buffers as large as a tensor's shard; allocating them per call
// costs a fresh mapping whose pages are faulted in and cleared by the kernel every time
// (on a GPU, an allocation that synchronizes the device), plus a pass to zero them. A
// Workspace keeps, per purpose, the largest buffer asked for, in the memory of its
// device. Contents are not initialized. Contract: one operation at a time uses it (a
// communicator runs its operations one after the other), and each purpose has one user
// within an operation, so nested algorithms (hierarchical running a compressed ring)
// never share a buffer. A pointer stays valid until the next get() of its purpose.
#pragma once

#include <cstddef>
#include <memory>

#include "device/device_ops.h"

namespace pycomm {

enum class Scratch {
  Partials,  // hierarchical: fp32 partial sums (all-reduce: of this rank's shard; reduce-scatter: of its
             // column's segments); recursive doubling and halving: its partial
  Own,       // compressed: this rank's encoded piece
  Sent,      // compressed one-shot: this rank's contribution, encoded once for every peer
  Results,   // compressed tree: each half's encoded result piece; recursive halving: the result of
             // the segment of a pair's first rank
  Column,    // hierarchical all-gather: the segments of this rank's column (its local index on every node)
  Shard,     // hierarchical reduce-scatter: this rank's segment reduced across nodes, not yet rounded
  Held,      // recursive halving (ordered or coded): the contributions it holds, next holds and receives;
             // Bruck all-gather (coded): every segment, encoded
  kCount
};

class Workspace {
 public:
  explicit Workspace(const DeviceOps& ops) : ops_(&ops) {}

  char* get(Scratch purpose, size_t bytes) {
    Buffer& b = buffers_[static_cast<int>(purpose)];
    if (bytes > b.capacity) {
      b.memory.reset();  // release before allocating: never hold both
      b.memory = ops_->allocate(bytes);
      b.capacity = bytes;
    }
    return b.memory.get();
  }

 private:
  struct Buffer {
    std::shared_ptr<char> memory;
    size_t capacity = 0;
  };
  const DeviceOps* ops_;
  Buffer buffers_[static_cast<int>(Scratch::kCount)];
};

}  // namespace pycomm
