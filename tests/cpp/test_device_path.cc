// Torch-free tests of the device path's host logic, without a GPU: a stand-in device
// runtime whose "device memory" is host memory (ops forwarded to the CPU ops, slot arenas
// that the threads playing the ranks map by address) carries collectives on device
// requests over the slot-arena shared-memory transport (as CUDA IPC does) and over TCP
// channels staged through device slots (which page-lock the TCP slots while they live).
// Every result must equal the host path's, bit for bit, for every algorithm, compressed
// and not, in every determinism mode.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "device/device_runtime.h"
#include "check.h"
#include "world.h"

using namespace pycomm;

namespace {

// Page-locking, as the staged channels ask for it: every range must start a page, and be
// released by the time its communicator is gone.
std::atomic<int> pins_made{0}, pins_held{0};

class HostOps final : public DeviceOps {
 public:
  std::shared_ptr<void> pin(void* host, size_t bytes) const override {
    CHECK(reinterpret_cast<uintptr_t>(host) % 4096 == 0 && bytes > 0, "pinned range %p (%zu bytes) does not start a page",
          host, bytes);
    ++pins_made;
    ++pins_held;
    return std::shared_ptr<void>(host, [](void*) { --pins_held; });
  }
  std::shared_ptr<char> allocate(size_t bytes) const override { return cpu_ops().allocate(bytes); }
  void copy(void* dst, const void* src, size_t bytes) const override { cpu_ops().copy(dst, src, bytes); }
  void reduce_terms(const ReduceSpec& spec, Stage stage, void* out, const Term* terms, int k,
                    size_t n) const override {
    cpu_ops().reduce_terms(spec, stage, out, terms, k, n);
  }
};

// Slots in this process's memory; the handle is the address (ranks are threads here).
class HostArena final : public SlotArena {
 public:
  const char* kind() const override { return "host-arena"; }
  std::string allocate(size_t bytes) override {
    memory_.reset(new char[bytes]);
    return std::to_string(reinterpret_cast<uintptr_t>(memory_.get()));
  }
  char* base() override { return memory_.get(); }
  char* map(const std::string& handle, int) override { return reinterpret_cast<char*>(std::stoull(handle)); }

 private:
  std::unique_ptr<char[]> memory_;
};

class HostRuntime final : public DeviceRuntime {
 public:
  const char* name() const override { return "host-test"; }
  std::unique_ptr<DeviceOps> make_ops(int) const override { return std::make_unique<HostOps>(); }
  std::unique_ptr<SlotArena> make_slot_arena(int) const override { return std::make_unique<HostArena>(); }
};

float value(int rank, size_t i) {
  const float magnitudes[] = {1e-3f, 1.0f, 3e2f, 7e4f};
  return static_cast<float>(static_cast<int>((i * 7919 + rank * 104729) % 2001) - 1000) * magnitudes[(i + rank) % 4] / 997.0f;
}

void test_device_matches_host(int n, TransportChoice transport, int ranks_per_node) {
  const auto configure = [&](Config& cfg) {
    cfg.transport = transport;
    cfg.ranks_per_node = ranks_per_node;
    cfg.cuda_chunk_bytes = 8192;
  };
  with_world(n, configure, [&](int r, Communicator& comm) {
    const size_t count = 5003;
    for (Algorithm a : {Algorithm::Auto, Algorithm::Ring, Algorithm::Tree, Algorithm::OneShot, Algorithm::TwoShot,
                        Algorithm::Hierarchical})
      for (Compression c : {Compression::None, Compression::Fp8E4M3})
        for (Determinism d : {Determinism::Default, Determinism::Ordered, Determinism::Exact}) {
          std::vector<float> host(count), device(count);
          for (size_t i = 0; i < count; ++i) host[i] = device[i] = value(r, i);
          for (int on_device : {0, 1}) {
            Request rq;
            rq.collective = Collective::AllReduce;
            rq.options.algorithm = a;
            rq.options.compression = c;
            rq.options.determinism = d;
            rq.count = count;
            rq.input = rq.output = on_device ? device.data() : host.data();
            rq.device = on_device ? 0 : -1;
            comm.validate(rq);
            comm.execute(rq);
          }
          // The device path may choose another algorithm for Auto; the others match.
          if (a != Algorithm::Auto || d != Determinism::Default)
            CHECK(std::memcmp(host.data(), device.data(), count * sizeof(float)) == 0,
                  "n=%d rank %d %s %s determinism %d: device bits differ from host bits", n, r, name_of(a),
                  name_of(c), static_cast<int>(d));
        }
    // Reduce-scatter and all-gather, repeated so that device slots are reused across calls.
    std::vector<float> mine(count * n), device(count * n), host(count * n);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = value(r, i);
    for (int rep = 0; rep < 20; ++rep)
      for (Collective c : {Collective::ReduceScatter, Collective::AllGather})
        for (int on_device : {0, 1}) {
          Request rq;
          rq.collective = c;
          rq.input = mine.data();
          rq.output = (on_device ? device : host).data();
          rq.count = count;
          rq.device = on_device ? 0 : -1;
          comm.validate(rq);
          comm.execute(rq);
          const size_t out = c == Collective::ReduceScatter ? count : count * n;
          if (on_device)
            CHECK(std::memcmp(host.data(), device.data(), out * sizeof(float)) == 0,
                  "n=%d rank %d rep %d: device %s differs from host", n, r, rep, name_of(c));
        }
  });
}

}  // namespace

int main() {
  static const HostRuntime runtime;
  register_device_runtime(&runtime);
  test_device_matches_host(4, TransportChoice::Auto, 2);  // 2 nodes of 2: hierarchical
  CHECK(pins_made == 0, "%d host ranges pinned with no staged channel", pins_made.load());
  test_device_matches_host(3, TransportChoice::Tcp, 0);   // every frame staged over TCP
  CHECK(pins_made == 3 * 2 * 2, "%d host ranges pinned, expected 2 per staged channel", pins_made.load());
  CHECK(pins_held == 0, "%d pinned host ranges outlived their channels", pins_held.load());
  std::printf("test_device_path: %s (%d failures)\n", failures ? "FAILED" : "ok", failures);
  return failures ? 1 : 0;
}
