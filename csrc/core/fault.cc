#include "core/fault.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/config.h"
#include "core/error.h"
#include "core/types.h"

namespace pycomm {
namespace {

constexpr const char* kSyntax =
    "<rank>:<op>:<seq>:<point>:<action>[:<arg>] with point before|during|during@<k>|after and action "
    "kill|stop|exit[:<status>]|raise|delay:<ms>|drop|corrupt[:seq|count|bytes]|flip";
constexpr uint64_t kFlip = uint64_t{1} << 20;  // the bit corrupt flips in seq or count

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

std::string without_underscores(std::string s) {
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  return s;
}

// A decimal integer in [lo, hi], the whole of `s`; false otherwise.
bool integer(const std::string& s, long long lo, long long hi, long long& v) {
  if (s.empty() || !std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  errno = 0;
  v = std::strtoll(s.c_str(), &end, 10);
  return errno == 0 && *end == '\0' && v >= lo && v <= hi;
}

FaultSpec parse_one(const std::string& text) {
  const auto bad = [&](const std::string& why) {
    fail(ErrorKind::InvalidArgument,
         "pycomm: PYCOMM_FAULT spec '" + text + "': " + why + " (expected " + kSyntax + ")");
  };
  const std::vector<std::string> f = split(text, ':');
  if (f.size() != 5 && f.size() != 6) bad("has " + std::to_string(f.size()) + " fields");
  FaultSpec s;
  s.text = text;
  long long v = 0;
  if (!integer(f[0], 0, 1 << 20, v)) bad("rank '" + f[0] + "' is not a non-negative integer");
  s.rank = static_cast<int>(v);
  if (f[1] != "*") {
    for (int c = 0; c < kCollectiveCount; ++c)
      if (without_underscores(name_of(static_cast<Collective>(c))) == without_underscores(f[1])) s.collective = c;
    if (s.collective < 0) bad("op '" + f[1] + "' is not an operation name (allreduce, broadcast, ...) or *");
  }
  if (f[2] != "*") {
    if (!integer(f[2], 0, 1LL << 62, v)) bad("seq '" + f[2] + "' is not a non-negative integer or *");
    s.seq = v;
  }
  const std::string& point = f[3];
  if (point == "before") {
    s.point = FaultPoint::Before;
  } else if (point == "after") {
    s.point = FaultPoint::After;
  } else if (point == "during") {
    s.point = FaultPoint::During;
  } else if (point.rfind("during@", 0) == 0 && integer(point.substr(7), 0, 1LL << 40, v)) {
    s.point = FaultPoint::During;
    s.frame = static_cast<uint64_t>(v);
  } else {
    bad("point '" + point + "' is not before, during, during@<k> or after");
  }
  const std::string& action = f[4];
  const bool has_arg = f.size() == 6;
  const std::string arg = has_arg ? f[5] : "";
  if (action == "kill") s.action = FaultAction::Kill;
  else if (action == "stop") s.action = FaultAction::Stop;
  else if (action == "raise") s.action = FaultAction::Raise;
  else if (action == "drop") s.action = FaultAction::Drop;
  else if (action == "exit") {
    s.action = FaultAction::Exit;
    if (has_arg && !integer(arg, 0, 255, v)) bad("exit status '" + arg + "' is not in 0..255");
    s.exit_status = has_arg ? static_cast<int>(v) : 0;
  } else if (action == "delay") {
    s.action = FaultAction::Delay;
    if (!has_arg || !integer(arg, 0, 3600000, v)) bad("delay needs milliseconds in 0..3600000");
    s.delay_ms = static_cast<int>(v);
  } else if (action == "corrupt") {
    s.action = FaultAction::Corrupt;
    if (s.point != FaultPoint::During) bad("corrupt alters a frame: its point must be during or during@<k>");
    if (!has_arg || arg == "seq") s.field = HeaderField::Seq;
    else if (arg == "count") s.field = HeaderField::Count;
    else if (arg == "bytes") s.field = HeaderField::Bytes;
    else bad("corrupt field '" + arg + "' is not seq, count or bytes");
  } else if (action == "flip") {
    s.action = FaultAction::Flip;
    if (s.point != FaultPoint::After) bad("flip alters an operation's output: its point must be after");
  } else {
    bad("action '" + action + "' is not kill, stop, exit, raise, delay, drop, corrupt or flip");
  }
  const bool takes_arg =
      s.action == FaultAction::Exit || s.action == FaultAction::Delay || s.action == FaultAction::Corrupt;
  if (has_arg && !takes_arg) bad("action '" + action + "' takes no argument");
  return s;
}

bool matches(const FaultSpec& s, const OpStamp& op) {
  return (s.collective < 0 || s.collective == op.collective) && (s.seq < 0 || static_cast<uint64_t>(s.seq) == op.seq);
}

}  // namespace

std::vector<FaultSpec> FaultInjector::parse(const std::string& text) {
  std::vector<FaultSpec> specs;
  if (text.empty()) return specs;
  for (const std::string& one : split(text, ',')) specs.push_back(parse_one(one));
  return specs;
}

std::unique_ptr<FaultInjector> FaultInjector::make(const std::vector<FaultSpec>& specs, int rank) {
  std::vector<FaultSpec> mine;
  for (const FaultSpec& s : specs)
    if (s.rank == rank) mine.push_back(s);
  if (mine.empty()) return nullptr;
  return std::unique_ptr<FaultInjector>(new FaultInjector(std::move(mine)));
}

FaultInjector::FaultInjector(std::vector<FaultSpec> specs) : specs_(std::move(specs)), counts_(specs_.size()) {}

void FaultInjector::at(FaultPoint point, const OpStamp& op, const Abort& abort, const Flip& flip) const {
  for (const FaultSpec& s : specs_)
    if (s.point == point && matches(s, op))
      fire(s, op, point == FaultPoint::Before ? "before" : "after", abort, nullptr, flip);
}

void FaultInjector::before_send(FrameHeader& header, const Abort& abort) const {
  std::vector<const FaultSpec*> due;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < specs_.size(); ++i) {
      const FaultSpec& s = specs_[i];
      if (s.point != FaultPoint::During || !matches(s, header.op)) continue;
      FrameCount& c = counts_[i];
      if (!c.seen || !(c.op == header.op)) c = FrameCount{header.op, true, 0};
      if (c.frames++ == s.frame) due.push_back(&s);
    }
  }
  // Outside the lock: delay and stop block this thread, not another one that sends too.
  const OpStamp op = header.op;
  for (const FaultSpec* s : due) fire(*s, op, "at frame " + std::to_string(s->frame) + " of", abort, &header, nullptr);
}

void FaultInjector::fire(const FaultSpec& s, const OpStamp& op, const std::string& where, const Abort& abort,
                         FrameHeader* header, const Flip& flip) const {
  const std::string what = "pycomm: fault injected by PYCOMM_FAULT='" + s.text + "' on rank " + std::to_string(s.rank) +
                           " " + where + " " + name_of(static_cast<Collective>(op.collective)) + " #" +
                           std::to_string(op.seq);
  if (s.action != FaultAction::Delay) log_line(what);
  switch (s.action) {
    case FaultAction::Kill:
      ::kill(getpid(), SIGKILL);
      for (;;) pause();  // kill() may return before every thread is gone; never go on
    case FaultAction::Stop:
      ::kill(getpid(), SIGSTOP);  // returns once continued
      return;
    case FaultAction::Exit:
      _exit(s.exit_status);
    case FaultAction::Raise:
      fail(ErrorKind::Internal, what);
    case FaultAction::Delay:
      std::this_thread::sleep_for(std::chrono::milliseconds(s.delay_ms));
      return;
    case FaultAction::Drop:
      abort(what);
      return;
    case FaultAction::Corrupt:
      if (s.field == HeaderField::Seq) header->op.seq ^= kFlip;
      else if (s.field == HeaderField::Count) header->op.count ^= kFlip;
      else header->bytes = header->bytes ? header->bytes - 1 : 1;
      return;
    case FaultAction::Flip:
      if (flip) flip();
      return;
  }
}

}  // namespace pycomm
