// A CUDA team (device_runtime.h): the members' memory, mapped once through CUDA IPC, and
// the host side of each call: launch, wait, report. The kernel and its memory-visibility
// argument are in team_kernels.cu.
//
// Each member allocates one region of device memory: its flags (TeamWords, zero before any
// peer can map them), then two slots of kTeamBlocks pieces of `piece_bytes`. A call's
// outcome, the host's abort request and which blocks finished travel through words of
// page-locked host memory that the kernel reads and writes directly (ControlWords).
//
// Every kernel of a member runs on the team's own stream, in call order (the protocol
// needs a member's calls one after another). A call on a caller's stream is ordered
// around it by events, all on the device: the team's stream waits for what the caller's
// stream holds, and the caller's stream for the kernel, so the host waits for nothing,
// and a CUDA graph capturing the caller's stream captures the kernel (a fork and join).
// While such calls run, a watchdog thread checks every kLivenessSlice that the peers'
// processes still run, and aborts the kernel's waits when one has exited; a call's
// failure is raised by the team's next call.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/config.h"
#include "core/peer_watch.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_runtime.h"
#include "cuda/team_kernels.h"

namespace pycomm {
namespace {

// The longest a leaving member waits for its peers to finish reading its last buffer.
constexpr std::chrono::seconds kDrainLimit{1};

// The page-locked words a kernel shares with its member's host threads: TeamControl's,
// then a word per block that a tracked call marks finished.
struct ControlWords : TeamControl {
  static constexpr int kFinished = kWords;
  static constexpr int kCount = kFinished + kTeamBlocks;
};

class CudaTeam final : public DeviceTeam {
 public:
  CudaTeam(int device, std::unique_ptr<SlotArena> arena, const TransportSetup& setup)
      : device_(device),
        arena_(std::move(arena)),
        capacity_(setup.config->cuda_flag_bytes),
        piece_bytes_(std::max<size_t>(
            256, std::min(setup.config->cuda_flag_bytes, setup.config->cuda_chunk_bytes) / kTeamBlocks & ~size_t{255})),
        slot_bytes_(piece_bytes_ * kTeamBlocks) {
    CudaDeviceScope scope(device_);
    // Owned from here, so that a set-up that fails below (a peer that never publishes,
    // say) releases them: the destructor does not run for a constructor that throws.
    cudaStream_t stream = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    stream_holder_.reset(stream);
    void* control = nullptr;
    cuda_check(cudaHostAlloc(&control, ControlWords::kCount * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc");
    control_holder_.reset(control);
    stream_ = stream;
    // The host's side of the words: atomics (abort() comes from any thread); the kernel's:
    // volatile ints, the same bytes.
    static_assert(sizeof(std::atomic<int>) == sizeof(int) && std::atomic<int>::is_always_lock_free);
    control_ = static_cast<std::atomic<int>*>(control);
    for (int i = 0; i < ControlWords::kCount; ++i) new (control_ + i) std::atomic<int>(0);
    void* on_device = nullptr;
    cuda_check(cudaHostGetDevicePointer(&on_device, control, 0), "cudaHostGetDevicePointer");
    call_.control = static_cast<int*>(on_device);
    finished_on_device_ = call_.control + ControlWords::kFinished;
    for (cudaEvent_t* e : {&inputs_ready_, &kernel_done_})
      cuda_check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate");
    const std::string handle = arena_->allocate(TeamWords::kBytes + 2 * slot_bytes_);
    cuda_check(cudaMemset(arena_->base(), 0, TeamWords::kBytes), "cudaMemset (team flags)");
    cuda_check(cudaDeviceSynchronize(), "team set-up");
    const auto handles =
        all_gather_strings(*setup.store, setup.key_prefix + "/team", setup.rank, setup.size, handle, setup.deadline);
    call_.rank = setup.rank;
    call_.piece_bytes = piece_bytes_;
    for (int s = 0; s < 2; ++s) call_.slots[s].k = setup.size;
    for (int r = 0; r < setup.size; ++r) {
      call_.flags[r] = reinterpret_cast<uint32_t*>(r == setup.rank ? arena_->base() : arena_->map(handles[r], r));
      for (int s = 0; s < 2; ++s) {
        call_.slots[s].data[r] = region(r) + TeamWords::kBytes + s * slot_bytes_;
        call_.slots[s].form[r] = Form::Input;
      }
      if (r != setup.rank) peers_.emplace_back(r, std::make_unique<PeerWatch>(setup.ranks[r].pid));
    }
  }

  ~CudaTeam() override {
    if (watchdog_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
      }
      wake_.notify_all();
      watchdog_.join();
    }
    CudaDeviceScope scope(device_);
    cudaStreamSynchronize(stream_);
    drain();
    cudaEventDestroy(inputs_ready_);
    cudaEventDestroy(kernel_done_);
  }

  size_t capacity() const override { return capacity_; }

  void all_reduce(const ReduceSpec& spec, void* out, const void* in, size_t n, const Deadline& deadline,
                  void* stream) override {
    if (n == 0) return;
    if (broken_) fail(ErrorKind::PeerFailure, "pycomm: the GPU team failed earlier");
    // A call enqueued on a caller's stream (or replayed from a graph) that failed.
    if (const int earlier = control_[ControlWords::kOutcome].load())
      fail_with(earlier, " (in an earlier call, enqueued on a caller's stream)");
    CudaDeviceScope scope(device_);
    called_ = true;
    call_.budget_ns = static_cast<uint64_t>(std::chrono::nanoseconds(deadline.remaining()).count());
    if (stream) return enqueue(spec, out, in, n, static_cast<cudaStream_t>(stream));
    call_.finished = nullptr;
    launch_team_allreduce(spec, call_, out, in, n, stream_);
    wait();
    if (const int outcome = control_[ControlWords::kOutcome].load()) fail_with(outcome, "");
  }

  void abort() override { control_[ControlWords::kAbort].store(1); }

 private:
  // The call on the caller's stream (see the top of the file). A call a graph captures is
  // not tracked: its replays run when the graph's caller says.
  void enqueue(const ReduceSpec& spec, void* out, const void* in, size_t n, cudaStream_t caller) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cuda_check(cudaStreamIsCapturing(caller, &capture), "cudaStreamIsCapturing");
    const bool tracked = capture == cudaStreamCaptureStatusNone;
    cuda_check(cudaEventRecord(inputs_ready_, caller), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream_, inputs_ready_, 0), "cudaStreamWaitEvent");
    call_.finished = tracked ? finished_on_device_ : nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    if (tracked) call_.tracked = ++tracked_;
    const int blocks = launch_team_allreduce(spec, call_, out, in, n, stream_);
    cuda_check(cudaEventRecord(kernel_done_, stream_), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(caller, kernel_done_, 0), "cudaStreamWaitEvent");
    if (!tracked) return;
    tracked_blocks_ = blocks;
    if (!watchdog_.joinable()) watchdog_ = std::thread([this] { watch(); });
  }

  // Whether the last tracked call is still running: a block of it has not finished.
  bool tracked_call_running() const {
    for (int b = 0; b < tracked_blocks_; ++b)
      if (control_[ControlWords::kFinished + b].load(std::memory_order_acquire) != tracked_) return true;
    return false;
  }

  // The watchdog: while a tracked call runs, aborts its waits once a peer has exited.
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, kLivenessSlice, [this] { return stopping_; }))
      if (exited_.empty() && tracked_call_running() && !(exited_ = exited_peer()).empty()) abort();
  }

  // Until the kernel is done: polls, yielding the core between polls (a sleep would add
  // its wake-up latency to every call, as a blocking stream synchronization would), and
  // every kLivenessSlice checks that the peers still run; if one exited it tells the
  // kernel to stop waiting. The kernel's own bounded waits end it in any case.
  void wait() {
    const auto done = [this] {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaErrorNotReady) return false;
      cuda_check(e, "team all-reduce");
      return true;
    };
    const SpinPolicy slice{std::chrono::duration_cast<std::chrono::microseconds>(kLivenessSlice)};
    while (!spin_until(done, slice)) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (exited_.empty() && !(exited_ = exited_peer()).empty()) abort();
    }
  }

  [[noreturn]] void fail_with(int outcome, const std::string& when) {
    broken_ = true;
    if (outcome > 0)
      fail(ErrorKind::Timeout, "timed out waiting for rank " + std::to_string(outcome - 1) +
                                   " to arrive at the flag-synchronized all-reduce on the GPU" + when);
    std::lock_guard<std::mutex> lock(mutex_);
    fail(ErrorKind::PeerFailure, (exited_.empty() ? "the group was aborted" : exited_) + when);
  }

  // Member r's region, mapped: its flags come first.
  char* region(int r) const { return reinterpret_cast<char*>(call_.flags[r]); }

  // "rank 2 exited during ...", or empty while every peer runs.
  std::string exited_peer() const {
    for (const auto& [rank, watch] : peers_)
      if (watch->exited()) return "rank " + std::to_string(rank) + " exited during the flag-synchronized all-reduce";
    return {};
  }

  // Peers may still be reading this member's slots: before its memory goes, waits until
  // each said it is done (its done flags have reached this member's runs, block by block),
  // a peer exited, or kDrainLimit.
  void drain() {
    if (!called_ || broken_) return;
    std::vector<uint32_t> words(TeamWords::kCount);
    const auto give_up = Clock::now() + kDrainLimit;
    for (;;) {
      if (cudaMemcpy(words.data(), region(call_.rank), TeamWords::kBytes, cudaMemcpyDeviceToHost) != cudaSuccess)
        return;
      bool all = true;
      for (const auto& [rank, watch] : peers_)
        for (int b = 0; b < kTeamBlocks; ++b)
          all = all && count_reached(words[TeamWords::done(rank, b)], words[TeamWords::runs(b)]);
      if (all || Clock::now() >= give_up || !exited_peer().empty()) return;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  struct DestroyStream {
    void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
  };
  struct FreeHost {
    void operator()(void* p) const { cudaFreeHost(p); }
  };

  int device_;
  std::unique_ptr<SlotArena> arena_;  // this member's region and its mappings of the peers'
  size_t capacity_, piece_bytes_, slot_bytes_;
  std::unique_ptr<std::remove_pointer_t<cudaStream_t>, DestroyStream> stream_holder_;
  std::unique_ptr<void, FreeHost> control_holder_;
  cudaStream_t stream_ = nullptr;
  std::atomic<int>* control_ = nullptr;  // host side of TeamCall::control (ControlWords)
  int* finished_on_device_ = nullptr;     // ControlWords::kFinished, as the kernel sees it
  cudaEvent_t inputs_ready_ = nullptr, kernel_done_ = nullptr;  // ordering calls on callers' streams
  std::thread watchdog_;                  // started by the first tracked call
  std::mutex mutex_;                      // guards what follows, and exited_
  std::condition_variable wake_;
  bool stopping_ = false;
  int tracked_ = 0, tracked_blocks_ = 0;  // the last tracked call's number and blocks
  std::vector<std::pair<int, std::unique_ptr<PeerWatch>>> peers_;
  TeamCall call_{};
  bool called_ = false;
  bool broken_ = false;  // a call failed: the members' counts of chunks no longer agree
  std::string exited_;   // why the kernel was told to stop, when a peer exited (mutex_)
};

// Whether every member's kernel can run while its peers' do: no two members share a
// device unless MPS shares that device's contexts. Where processes time-slice a device, a
// waiting kernel keeps it for its time slice before the peer it waits for can arrive.
// Every member decides from the same published descriptions.
bool members_run_at_once(int device, const TransportSetup& setup) {
  char bus[32] = {};
  int mps = 0;
  cuda_check(cudaDeviceGetPCIBusId(bus, sizeof bus, device), "cudaDeviceGetPCIBusId");
  cuda_check(cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, device), "cudaDeviceGetAttribute");
  const auto all = all_gather_strings(*setup.store, setup.key_prefix + "/team/device", setup.rank, setup.size,
                                      std::string(mps ? "mps " : "sliced ") + bus, setup.deadline);
  std::map<std::string, int> members_on;  // by bus id
  const auto bus_of = [](const std::string& d) { return d.substr(d.find(' ') + 1); };
  for (const std::string& d : all) ++members_on[bus_of(d)];
  for (const std::string& d : all)
    if (members_on[bus_of(d)] > 1 && d.compare(0, 4, "mps ") != 0) return false;
  return true;
}

}  // namespace

std::unique_ptr<DeviceTeam> make_cuda_team(int device, std::unique_ptr<SlotArena> arena, const TransportSetup& setup) {
  if (setup.size > kMaxTeam) return nullptr;
  CudaDeviceScope scope(device);
  if (!members_run_at_once(device, setup) && setup.config->cuda_flags != CudaFlags::Always) return nullptr;
  return std::make_unique<CudaTeam>(device, std::move(arena), setup);
}

}  // namespace pycomm
