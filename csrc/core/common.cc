// Small shared pieces of the core: names, errno messages, spinning, the store helper,
// frame checks.
#include <sched.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "error.h"
#include "deadline.h"
#include "store.h"
#include "transport.h"
#include "types.h"

namespace pycomm {

std::string errno_message(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

bool spin_until(const std::function<bool()>& ready, const SpinPolicy& policy) {
  if (ready()) return true;
  if (policy.spin.count() <= 0) return false;
  const auto until = Clock::now() + policy.spin;
  do {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    sched_yield();
  } while (Clock::now() < until);
  return ready();
}

std::vector<std::string> all_gather_strings(Store& store, const std::string& prefix, int rank,
                                            int size, const std::string& mine, const Deadline& deadline) {
  store.set(prefix + "/" + std::to_string(rank), mine);
  std::vector<std::string> all(size);
  for (int r = 0; r < size; ++r) {
    if (r == rank) {
      all[r] = mine;
      continue;
    }
    const std::string key = prefix + "/" + std::to_string(r);
    if (!store.wait(key, deadline.remaining()))
      fail(ErrorKind::Timeout, "pycomm: timed out creating a group: rank " + std::to_string(r) +
                                   " did not join (rank " + std::to_string(rank) + " waited for it)");
    all[r] = store.get(key);
  }
  return all;
}

std::string PeerInfo::describe() const {
  std::ostringstream os;
  os << "rank " << rank << " (pid " << pid << " on " << hostname << ")";
  return os.str();
}

std::string describe(const OpStamp& op) {
  std::ostringstream os;
  const auto c = static_cast<Collective>(op.collective);
  os << name_of(c) << " #" << op.seq << " (" << name_of(static_cast<DataType>(op.dtype));
  if (reduces(c))
    os << ", " << name_of(static_cast<ReduceKind>(op.reduce));
  os << ", " << op.count << " elements";
  if (selects_algorithm(c))
    os << ", " << name_of(static_cast<Algorithm>(op.algorithm));
  if (op.compression)
    os << ", " << name_of(static_cast<Compression>(op.compression)) << "/" << (size_t{1} << op.compression_block);
  if (has_root(c))
    os << ", root " << op.root;
  if (c == Collective::Send || c == Collective::Recv) os << ", tag " << op.root;
  os << ")";
  return os.str();
}

// The first field of a received stamp that describe() cannot print, as "<field> <value>",
// or "": enums out of range (their name is "?") and blocks that do not fit a size_t.
static std::string field_out_of_range(const OpStamp& op) {
  const auto unknown = [](const char* name) { return std::string(name) == "?"; };
  const struct {
    const char* field;
    unsigned value;
    bool bad;
  } fields[] = {
      {"collective", op.collective, unknown(name_of(static_cast<Collective>(op.collective)))},
      {"dtype", op.dtype, unknown(name_of(static_cast<DataType>(op.dtype)))},
      {"reduce op", op.reduce, unknown(name_of(static_cast<ReduceKind>(op.reduce)))},
      {"algorithm", op.algorithm, unknown(name_of(static_cast<Algorithm>(op.algorithm)))},
      {"compression", op.compression, unknown(name_of(static_cast<Compression>(op.compression)))},
      {"compression block", op.compression_block, op.compression_block >= 64},
      {"determinism", op.determinism, unknown(name_of(static_cast<Determinism>(op.determinism)))},
  };
  for (const auto& f : fields)
    if (f.bad) return std::string(f.field) + " " + std::to_string(f.value);
  return "";
}

void check_frame(const FrameHeader& got, const FrameHeader& expect, const PeerInfo& peer) {
  if (got.magic != kFrameMagic || got.kind != static_cast<uint16_t>(FrameKind::Data))
    fail(ErrorKind::Mismatch, "malformed frame from " + peer.describe());
  if (!(got.op == expect.op)) {
    // `got` came off the wire: only a stamp whose fields are all in range is described.
    const std::string bad = field_out_of_range(got.op);
    if (!bad.empty()) fail(ErrorKind::Mismatch, "malformed frame from " + peer.describe() + ": " + bad);
    fail(ErrorKind::Mismatch, peer.describe() + " is in " + describe(got.op) +
                                  " but this rank is in " + describe(expect.op) +
                                  ": ranks called different collectives or arguments");
  }
  if (got.bytes != expect.bytes)
    fail(ErrorKind::Mismatch, peer.describe() + " sent " + std::to_string(got.bytes) +
                                  " bytes where " + std::to_string(expect.bytes) +
                                  " were expected in " + describe(expect.op));
}

}  // namespace pycomm
