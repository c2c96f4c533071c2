// The flow control of a device team's all-reduce (cuda/team_kernels.cu): how the members'
// kernels pipeline a call of any size through two slots of each member's memory, with no
// host thread between chunks. Plain code over a Memory policy (acquire loads and release
// stores at system scope, a clock, a pause), so that the kernels run it on the device and
// tests/cpp/test_team_protocol.cc runs the same steps on host threads, over host memory.
//
// Memory: load_acquire and store_release of a flag word (system scope), load_word and
// store_word of a control word (read and written by the host while the block runs),
// now_ns(), pause() (between checks of a long wait).
//
// Each member owns a region that every member maps: its flag words (TeamWords), then two
// slots, each cut into one piece per block. Block b always moves the elements of piece b
// (TeamPieces): the elements of chunk c at piece b go through piece b of a slot, and no
// other block of any member touches that piece. Block b's r-th chunk in the group's life,
// r = runs + c + 1 (runs: the block's chunks before this call, kept in the member's own
// region, so that a call replayed from a CUDA graph finds them there), goes through slot
// (r - 1) % 2. For each of its chunks, block b of member m:
//   1. copies its elements of the chunk into its piece of its slot;
//   2. arrives: stores r into arrived[m][b] in every peer's region (release);
//   3. waits until arrived[p][b] in its own region reaches r for every peer p (acquire);
//   4. folds its piece of every member's slot, in member order, into the output.
// After its last chunk it stores done[m][b] = its count in every peer's region, which a
// member leaving the team waits for before its memory goes.
//
// Why a piece is never overwritten while a peer reads it: block b of member m writes piece
// b of slot s again at its chunk r + 2, after step 3 of chunk r + 1, for which block b of
// every peer p arrived at r + 1, which it did after step 4 of chunk r, its last read of
// that piece; and only blocks b read or write pieces b, whatever the calls' lengths. Hence
// also no counter is ever more than one ahead of the chunk that waits on it. Counters are
// compared modulo 2^32 (count_reached).
//
// Bounded waits: a wait gives up once the call's budget has passed or the host raised
// the abort word (the group aborted, a peer process exited), and records why in the
// outcome word (TeamControl, TeamOutcome); it never waits past either.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/numerics.h"  // PYCOMM_HD

namespace pycomm {

constexpr int kMaxTeam = 64;
// The most blocks of a team kernel: each block has its own flags.
constexpr int kTeamBlocks = 64;
constexpr size_t kTeamFlags = static_cast<size_t>(kMaxTeam) * kTeamBlocks;
// A waiting block looks at the clock and the host's abort word once every this many polls
// of its flag: both cost more than a flag in its own memory.
constexpr uint32_t kTeamPollsPerCheck = 64;

// control[1] after a call: kTeamDone, kTeamAborted, or p + 1 where member p did not
// arrive within the budget.
enum TeamOutcome : int { kTeamDone = 0, kTeamAborted = -1 };

// The words of host memory that a member's blocks share with its host threads, by index:
// the host's abort request, the outcome (TeamOutcome); a runtime may add its own after.
struct TeamControl {
  static constexpr int kAbort = 0, kOutcome = 1, kWords = 2;
};

// The flag words of a member's region, by index from its start.
struct TeamWords {
  static PYCOMM_HD size_t arrived(int from, int block) { return static_cast<size_t>(from) * kTeamBlocks + block; }
  static PYCOMM_HD size_t done(int from, int block) { return kTeamFlags + arrived(from, block); }
  static PYCOMM_HD size_t runs(int block) { return 2 * kTeamFlags + block; }
  static constexpr size_t kCount = 2 * kTeamFlags + kTeamBlocks;
  static constexpr size_t kBytes = kCount * sizeof(uint32_t);
};

PYCOMM_HD bool count_reached(uint32_t count, uint32_t target) { return static_cast<int32_t>(count - target) >= 0; }

// A call's cut: chunks of `blocks` pieces of `piece` elements, piece b of each chunk
// block b's (the last chunk's pieces may be short or empty).
struct TeamPieces {
  size_t n, piece;
  int blocks;
  PYCOMM_HD size_t chunk() const { return piece * blocks; }
  // The blocks a call runs: those with elements in its first chunk.
  PYCOMM_HD int launched() const {
    const size_t needed = (n + piece - 1) / piece;
    return needed < static_cast<size_t>(blocks) ? static_cast<int>(needed) : blocks;
  }
  // Block b's chunks in the call.
  PYCOMM_HD uint32_t chunks(int b) const {
    const size_t first = b * piece;
    return first < n ? static_cast<uint32_t>((n - first + chunk() - 1) / chunk()) : 0;
  }
  PYCOMM_HD size_t begin(uint32_t c, int b) const { return c * chunk() + b * piece; }
  PYCOMM_HD size_t length(uint32_t c, int b) const {
    const size_t first = begin(c, b);
    return first >= n ? 0 : n - first < piece ? n - first : piece;
  }
};

// One block of one member in one call: its view of every member's flags.
template <class Memory>
struct TeamBlock {
  Memory memory;
  uint32_t* const* flags;   // flags[m]: member m's region, mapped here
  int rank, size, block;
  int* control;             // TeamControl's words
  uint64_t start_ns, budget_ns;

  PYCOMM_HD uint32_t* own(size_t word) const { return flags[rank] + word; }

  // Step 2, towards one peer.
  PYCOMM_HD void arrive(int peer, uint32_t r) const {
    memory.store_release(flags[peer] + TeamWords::arrived(rank, block), r);
  }
  // Step 3, for one peer: false once it gave up (control[1] says why).
  PYCOMM_HD bool wait_for(int peer, uint32_t r) const {
    const uint32_t* flag = own(TeamWords::arrived(peer, block));
    for (uint32_t polls = 1; !count_reached(memory.load_acquire(flag), r); ++polls) {
      if (polls % kTeamPollsPerCheck) continue;
      const bool aborted = memory.load_word(control + TeamControl::kAbort) != 0;
      if (aborted || memory.now_ns() - start_ns > budget_ns) {
        memory.store_word(control + TeamControl::kOutcome, aborted ? kTeamAborted : peer + 1);
        return false;
      }
      memory.pause();
    }
    return true;
  }
  // After the last chunk, towards one peer: it may free what it lent this member.
  PYCOMM_HD void finish(int peer, uint32_t r) const {
    memory.store_release(flags[peer] + TeamWords::done(rank, block), r);
  }
};

// A block's whole call, on a Lanes policy that says how the block's threads share the
// steps: copy(c, slot) and fold(c, slot) (every thread its elements of the block's piece
// of chunk c), sync(),
// peers(f) (f(p) for each peer p, each by some thread; on the host one thread calls all),
// any(bool) (a barrier that ors the block's flags), first_thread(f) (f by one thread).
// Returns false when the block gave up; its runs are then not updated, and the team is
// broken.
template <class Memory, class Lanes>
PYCOMM_HD bool run_team_block(const TeamBlock<Memory>& b, const TeamPieces& pieces, Lanes& lanes) {
  const uint32_t runs = *b.own(TeamWords::runs(b.block));
  const uint32_t count = pieces.chunks(b.block);
  for (uint32_t c = 0; c < count; ++c) {
    const uint32_t r = runs + c + 1;
    const int slot = static_cast<int>((r - 1) & 1);
    lanes.copy(c, slot);
    lanes.sync();
    bool gave_up = false;
    lanes.peers([&](int p) { b.arrive(p, r); });
    lanes.peers([&](int p) { gave_up = gave_up || !b.wait_for(p, r); });
    if (lanes.any(gave_up)) return false;
    lanes.fold(c, slot);
  }
  lanes.sync();
  lanes.first_thread([&] { *b.own(TeamWords::runs(b.block)) = runs + count; });
  lanes.peers([&](int p) { b.finish(p, runs + count); });
  return true;
}

}  // namespace pycomm
