// The device team's flow control (device/team_protocol.h) on host threads: each member's
// blocks are threads running run_team_block over host atomics, the members' regions and
// slots in shared memory, so that the protocol the kernels run is proven without a GPU.
// Members are threads of this process, or processes (a peer that dies must be one):
//   - values: every call of any length through the two slots folds every member's input
//     in member order, calls after calls, counters across 2^32 included;
//   - a peer that stops mid-call: every other member gives up within its budget and names
//     it;
//   - an abort from the host: every waiting member gives up at once;
//   - a peer process killed mid-call: the others' host side sees it exit and aborts their
//     blocks, which give up at once, long before their budget.
// No waiting depends on spinning: a wait sleeps between its checks (HostMemory::pause).
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "check.h"
#include "core/peer_watch.h"
#include "device/team_protocol.h"

using namespace pycomm;
using Clock = std::chrono::steady_clock;

namespace {

struct HostMemory {
  uint32_t load_acquire(const uint32_t* p) const { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  void store_release(uint32_t* p, uint32_t v) const { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  int load_word(const int* p) const { return __atomic_load_n(p, __ATOMIC_RELAXED); }
  void store_word(int* p, int v) const { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
  uint64_t now_ns() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  }
  void pause() const { std::this_thread::sleep_for(std::chrono::microseconds(50)); }
};

constexpr size_t kMaxSlot = 64;  // floats per slot, at most

// The members' regions, slots and control words, in memory that forked members share.
class Board {
 public:
  // `blocks` pieces of `piece` elements a slot.
  Board(int size, int blocks, size_t piece) : size_(size), blocks_(blocks), piece_(piece) {
    bytes_ = size * (TeamWords::kBytes + 2 * kMaxSlot * sizeof(float) + TeamControl::kWords * sizeof(int));
    base_ = static_cast<char*>(mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    for (int m = 0; m < size; ++m) flags_[m] = reinterpret_cast<uint32_t*>(base_ + m * TeamWords::kBytes);
  }
  ~Board() { munmap(base_, bytes_); }
  Board(const Board&) = delete;
  Board& operator=(const Board&) = delete;

  int size() const { return size_; }
  TeamPieces pieces(size_t n) const { return TeamPieces{n, piece_, blocks_}; }
  uint32_t* const* flags() const { return flags_; }
  float* slot(int member, int s) const {
    return reinterpret_cast<float*>(base_ + size_ * TeamWords::kBytes) + (member * 2 + s) * kMaxSlot;
  }
  int* control(int member) const {
    return reinterpret_cast<int*>(base_ + size_ * (TeamWords::kBytes + 2 * kMaxSlot * sizeof(float))) +
           TeamControl::kWords * member;
  }
  // Every member's counters as if each block had already run `runs` chunks.
  void start_counts_at(uint32_t runs) {
    for (int m = 0; m < size_; ++m)
      for (int b = 0; b < kTeamBlocks; ++b) {
        flags_[m][TeamWords::runs(b)] = runs;
        for (int p = 0; p < size_; ++p) flags_[m][TeamWords::arrived(p, b)] = flags_[m][TeamWords::done(p, b)] = runs;
      }
  }

 private:
  int size_, blocks_;
  size_t piece_, bytes_;
  char* base_;
  uint32_t* flags_[kMaxTeam] = {};
};

// What a member that stops does: at chunk `chunk` of its call `call`, it stops before
// copying, until `resume` is set (or forever).
struct Stop {
  int call = -1;
  uint32_t chunk = 0;
  const int* resume = nullptr;
};

// team_protocol.h's Lanes for one block thread: its piece of each chunk, folded in member
// order.
struct HostLanes {
  const Board& board;
  int rank, block;
  const float* in;
  float* out;
  TeamPieces pieces;
  bool stop_here;
  Stop stop;

  void copy(uint32_t c, int slot) {
    if (stop_here && c == stop.chunk)
      while (!stop.resume || !__atomic_load_n(stop.resume, __ATOMIC_ACQUIRE))
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::memcpy(board.slot(rank, slot) + block * pieces.piece, in + pieces.begin(c, block),
                pieces.length(c, block) * sizeof(float));
  }
  void fold(uint32_t c, int slot) {
    const size_t at = block * pieces.piece;
    for (size_t e = 0; e < pieces.length(c, block); ++e) {
      float acc = board.slot(0, slot)[at + e];
      for (int m = 1; m < board.size(); ++m) acc += board.slot(m, slot)[at + e];
      out[pieces.begin(c, block) + e] = acc;
    }
  }
  void sync() const {}
  bool any(bool mine) const { return mine; }
  template <class F>
  void peers(F&& f) const {
    for (int p = 0; p < board.size(); ++p)
      if (p != rank) f(p);
  }
  template <class F>
  void first_thread(F&& f) const {
    f();
  }
};

// One member's call: the blocks it launches, as threads. Returns its outcome (TeamOutcome).
int run_member(const Board& board, int rank, const float* in, float* out, size_t n, std::chrono::milliseconds budget,
               int call, const Stop& stop, int stopper) {
  int* control = board.control(rank);
  __atomic_store_n(control + TeamControl::kOutcome, 0, __ATOMIC_RELAXED);
  const HostMemory memory;
  const TeamPieces pieces = board.pieces(n);
  std::vector<std::thread> threads;
  for (int b = 0; b < pieces.launched(); ++b)
    threads.emplace_back([&, b] {
      const TeamBlock<HostMemory> block{memory,
                                        board.flags(),
                                        rank,
                                        board.size(),
                                        b,
                                        control,
                                        memory.now_ns(),
                                        static_cast<uint64_t>(budget.count()) * 1000000};
      HostLanes lanes{board, rank, b, in, out, pieces, rank == stopper && call == stop.call, stop};
      run_team_block(block, pieces, lanes);
    });
  for (auto& t : threads) t.join();
  return __atomic_load_n(control + TeamControl::kOutcome, __ATOMIC_RELAXED);
}

// Member m's input of call `call`: values whose sum depends on the order of its terms.
float input(int m, int call, size_t e) {
  const uint32_t h = (m * 2654435761u) ^ (call * 40503u) ^ (static_cast<uint32_t>(e) * 2246822519u);
  return static_cast<float>(static_cast<int32_t>(h % 2000001) - 1000000) * (1.0f + m * 1e-3f) / 997.0f;
}

// Members as threads run `lengths` calls one after another; member `stop` stops as told.
// Returns each member's outcome of each call; checks the values of calls that finished.
std::vector<std::vector<int>> run_threads(Board& board, const std::vector<size_t>& lengths,
                                          std::chrono::milliseconds budget, const Stop& stop = {}, int stopper = -1) {
  const int size = board.size();
  std::vector<std::vector<int>> outcomes(size, std::vector<int>(lengths.size(), 0));
  std::vector<std::thread> members;
  for (int m = 0; m < size; ++m)
    members.emplace_back([&, m] {
      for (size_t call = 0; call < lengths.size(); ++call) {
        const size_t n = lengths[call];
        std::vector<float> in(n), out(n, -1.0f);
        for (size_t e = 0; e < n; ++e) in[e] = input(m, call, e);
        outcomes[m][call] = run_member(board, m, in.data(), out.data(), n, budget, call, stop, stopper);
        if (outcomes[m][call] != kTeamDone) return;
        for (size_t e = 0; e < n; ++e) {
          float want = input(0, call, e);
          for (int p = 1; p < size; ++p) want += input(p, call, e);
          if (std::memcmp(&want, &out[e], sizeof want) != 0) {
            CHECK(false, "member %d call %zu element %zu of %zu: %.9g, want %.9g", m, call, e, n, out[e], want);
            return;
          }
        }
      }
    });
  for (auto& t : members) t.join();
  return outcomes;
}

// Calls of lengths that leave pieces short, blocks idle and chunks partly filled: every
// call's values, and afterwards every block's count of chunks, the same in every member
// and said done by every peer.
void test_values() {
  const std::vector<size_t> lengths = {1, 7, 8, 50, 3, 64, 13, 200, 2};
  for (int size : {2, 3, 5})
    for (int blocks : {1, 3}) {
      Board board(size, blocks, 4);
      const auto outcomes = run_threads(board, lengths, std::chrono::seconds(60));
      for (int m = 0; m < size; ++m)
        for (size_t c = 0; c < lengths.size(); ++c)
          CHECK(outcomes[m][c] == kTeamDone, "size %d blocks %d: member %d call %zu outcome %d", size, blocks, m, c,
                outcomes[m][c]);
      for (int b = 0; b < blocks; ++b) {
        uint32_t chunks = 0;
        for (size_t n : lengths) chunks += board.pieces(n).chunks(b);
        for (int m = 0; m < size; ++m) {
          CHECK(board.flags()[m][TeamWords::runs(b)] == chunks, "member %d block %d ran %u chunks, want %u", m, b,
                board.flags()[m][TeamWords::runs(b)], chunks);
          for (int p = 0; p < size; ++p)
            if (p != m)
              CHECK(board.flags()[m][TeamWords::done(p, b)] == chunks, "member %d block %d: done from %d is %u", m, b,
                    p, board.flags()[m][TeamWords::done(p, b)]);
        }
      }
    }
}

void test_counters_wrap() {
  Board board(3, 2, 2);
  board.start_counts_at(0xfffffffdu);
  const auto outcomes = run_threads(board, {9, 17, 5}, std::chrono::seconds(60));
  for (int m = 0; m < 3; ++m)
    for (int c = 0; c < 3; ++c)
      CHECK(outcomes[m][c] == kTeamDone, "wrap: member %d call %d outcome %d", m, c, outcomes[m][c]);
  const uint32_t runs = board.flags()[0][TeamWords::runs(0)];
  CHECK(runs == 0xfffffffdu + 3 + 5 + 2, "wrap: runs %u", runs);
}

// Member 1 stops at chunk 2 of its second call: the others give up within the budget,
// naming it; the stopped member, resumed, gives up too (its peers are gone).
void test_stopped_peer_is_named() {
  for (int size : {2, 4}) {
    Board board(size, 2, 4);
    int resume = 0;
    const auto budget = std::chrono::milliseconds(300);
    const auto start = Clock::now();
    std::thread resumer([&] {
      std::this_thread::sleep_for(std::chrono::seconds(2));
      __atomic_store_n(&resume, 1, __ATOMIC_RELEASE);
    });
    const auto outcomes = run_threads(board, {40, 40}, budget, Stop{1, 2, &resume}, 1);
    resumer.join();
    for (int m = 0; m < size; ++m)
      CHECK(outcomes[m][0] == kTeamDone, "stop: member %d first call %d", m, outcomes[m][0]);
    for (int m = 0; m < size; ++m)
      if (m != 1)
        CHECK(outcomes[m][1] == 2, "stop, %d members: member %d outcome %d, want 2 (member 1)", size, m,
              outcomes[m][1]);
    CHECK(outcomes[1][1] != kTeamDone, "stop: the stopped member finished a call its peers left");
    CHECK(Clock::now() - start < std::chrono::seconds(10), "stop: took too long");
  }
}

// The host raises the abort word while members wait for a stopped peer: they give up at once,
// long before a budget of a minute.
void test_abort_ends_every_wait() {
  Board board(3, 2, 4);
  int resume = 0;
  const auto start = Clock::now();
  std::thread host([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    for (int m = 0; m < 3; ++m) __atomic_store_n(board.control(m) + TeamControl::kAbort, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&resume, 1, __ATOMIC_RELEASE);
  });
  const auto outcomes = run_threads(board, {40}, std::chrono::seconds(60), Stop{0, 1, &resume}, 2);
  host.join();
  for (int m = 0; m < 2; ++m) CHECK(outcomes[m][0] == kTeamAborted, "abort: member %d outcome %d", m, outcomes[m][0]);
  CHECK(Clock::now() - start < std::chrono::seconds(10), "abort: waits outlived the abort");
}

// Members as processes; member 1 stops at chunk 1 and is killed. Each survivor's host
// thread watches its peers' processes, as a CUDA team's host side does, and aborts its
// blocks when one exits: they give up at once, with a budget of a minute.
void test_killed_peer_process() {
  constexpr int kSize = 3;
  Board board(kSize, 2, 4);
  std::vector<pid_t> pids(kSize, 0);
  // Every member's pid, published before any member starts (the peers watch them).
  pid_t* published = static_cast<pid_t*>(
      mmap(nullptr, kSize * sizeof(pid_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  int* go = reinterpret_cast<int*>(published) + kSize;  // within the same page
  const auto start = Clock::now();
  for (int m = 0; m < kSize; ++m) {
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      while (!__atomic_load_n(go, __ATOMIC_ACQUIRE)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::vector<float> in(40, 1.0f), out(40);
      int outcome = kTeamDone;
      std::thread blocks([&] {
        outcome =
            run_member(board, m, in.data(), out.data(), in.size(), std::chrono::seconds(60), 0, Stop{0, 1, nullptr}, 1);
      });
      std::vector<std::unique_ptr<PeerWatch>> peers;
      for (int p = 0; p < kSize; ++p)
        if (p != m) peers.push_back(std::make_unique<PeerWatch>(published[p]));
      int done = 0;
      std::thread waiter([&] {
        blocks.join();
        __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
      });
      while (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) {
        for (const auto& w : peers)
          if (w->exited()) __atomic_store_n(board.control(m) + TeamControl::kAbort, 1, __ATOMIC_RELAXED);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      waiter.join();
      _exit(outcome == kTeamAborted ? 0 : 10 + outcome);
    }
    pids[m] = published[m] = pid;
  }
  __atomic_store_n(go, 1, __ATOMIC_RELEASE);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  kill(pids[1], SIGKILL);
  waitpid(pids[1], nullptr, 0);
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  for (int m = 0; m < kSize; ++m) {
    if (m == 1) continue;
    int status = -1;
    while (waitpid(pids[m], &status, WNOHANG) == 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (Clock::now() >= deadline) {
      CHECK(false, "killed peer: member %d still waiting at the deadline: killed", m);
      kill(pids[m], SIGKILL);
      waitpid(pids[m], nullptr, 0);
      continue;
    }
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "killed peer: member %d exited with %d (want aborted)", m,
          WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  CHECK(Clock::now() - start < std::chrono::seconds(10), "killed peer: the survivors took too long");
  munmap(published, kSize * sizeof(pid_t));
}

}  // namespace

int main() {
  test_values();
  test_counters_wrap();
  test_stopped_peer_is_named();
  test_abort_ends_every_wait();
  test_killed_peer_process();
  if (failures) std::fprintf(stderr, "%d team protocol checks failed\n", failures);
  else std::printf("team protocol: all checks passed\n");
  return failures ? 1 : 0;
}
