#include "runtime/recorder.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <sstream>

#include "core/error.h"

namespace pycomm {

namespace {

void json_string(std::ostream& os, const std::string& s) {
  os << '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      os << '\\' << c;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      os << buf;
    } else {
      os << c;
    }
  }
  os << '"';
}

const char* state_name(OpState s) {
  switch (s) {
    case OpState::Running:
      return "running";
    case OpState::Completed:
      return "completed";
    case OpState::Failed:
      return "failed";
  }
  return "?";
}

void record_json(std::ostream& os, const OpRecord& r, std::chrono::steady_clock::time_point now) {
  const OpStamp& s = r.stamp;
  const auto c = static_cast<Collective>(s.collective);
  const double us =
      r.state == OpState::Running ? std::chrono::duration<double, std::micro>(now - r.start).count() : r.duration_us;
  os << "{\"id\": " << r.id << ", \"collective\": \"" << name_of(c) << "\", \"seq\": " << s.seq << ", \"dtype\": \""
     << name_of(static_cast<DataType>(s.dtype)) << "\", \"count\": " << s.count << ", \"bytes\": " << r.bytes;
  if (reduces(c)) os << ", \"reduce_op\": \"" << name_of(static_cast<ReduceKind>(s.reduce)) << '"';
  if (has_root(c)) os << ", \"root\": " << s.root;
  if (c == Collective::Send || c == Collective::Recv) os << ", \"tag\": " << s.root;
  os << ", \"algorithm\": \"" << name_of(static_cast<Variant>(s.variant)) << "\", \"compression\": \""
     << name_of(static_cast<Compression>(s.compression)) << '"';
  if (s.compression) os << ", \"compression_block\": " << (uint64_t{1} << s.compression_block);
  os << ", \"determinism\": \"" << name_of(static_cast<Determinism>(s.determinism)) << "\", \"device\": \""
     << (r.device < 0 ? std::string("cpu") : "cuda:" + std::to_string(r.device)) << "\", \"state\": \""
     << state_name(r.state) << "\", \"start_unix_us\": " << r.start_unix_us << ", \"duration_us\": " << us;
  if (r.state == OpState::Failed) {
    os << ", \"error\": ";
    json_string(os, r.error);
  }
  os << '}';
}

void who_json(std::ostream& os, const Recorder::Who& who) {
  os << "\"group\": ";
  json_string(os, who.group);
  os << ", \"rank\": " << who.rank << ", \"size\": " << who.size;
}

int64_t unix_us_now() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

uint64_t Recorder::begin(const OpStamp& stamp, uint64_t bytes, int device,
                         std::chrono::steady_clock::time_point start) {
  OpRecord r;
  r.stamp = stamp;
  r.bytes = bytes;
  r.device = device;
  r.start_unix_us = unix_us_now();
  r.start = start;
  std::lock_guard<std::mutex> lock(mutex_);
  r.id = ++next_id_;
  if (capacity_) {
    if (recent_.size() < capacity_) recent_.push_back(r);
    else recent_[(r.id - 1) % capacity_] = r;
  }
  running_.push_back(std::move(r));
  return next_id_;
}

double Recorder::end(uint64_t id, const std::string& error) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = std::find_if(running_.begin(), running_.end(), [&](const OpRecord& r) { return r.id == id; });
  if (it == running_.end()) return 0;
  OpRecord& r = *it;
  r.state = error.empty() ? OpState::Completed : OpState::Failed;
  r.duration_us = std::chrono::duration<double, std::micro>(now - r.start).count();
  r.error = error;
  OpTotals& t = totals_[{r.stamp.collective, r.stamp.variant}];
  ++t.calls;
  t.failures += error.empty() ? 0 : 1;
  t.bytes += r.bytes;
  t.seconds += r.duration_us * 1e-6;
  if (capacity_) {
    OpRecord& kept = recent_[(id - 1) % capacity_];
    if (kept.id == id) kept = r;  // else overwritten since by later operations
  }
  const double us = r.duration_us;
  last_ = std::move(r);
  *it = std::move(running_.back());
  running_.pop_back();
  return us;
}

void Recorder::verified(bool agreed) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++verified_;
  mismatches_ += agreed ? 0 : 1;
}

std::string Recorder::stats_json(const Who& who, const Setup& setup) const {
  std::ostringstream os;
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  os << '{';
  who_json(os, who);
  if (!setup.transports.empty()) {
    os << ", \"setup\": {\"transports\": ";
    json_string(os, setup.transports);
    os << ", \"chunk_bytes\": " << setup.chunk_bytes << ", \"fallback\": ";
    if (setup.fallback.empty()) os << "null";
    else json_string(os, setup.fallback);
    os << '}';
  }
  os << ", \"collectives\": {";
  int open_collective = -1;
  for (const auto& [key, t] : totals_) {
    if (key.first != open_collective) {
      os << (open_collective < 0 ? "" : "}, ") << '"' << name_of(static_cast<Collective>(key.first)) << "\": {";
      open_collective = key.first;
    } else {
      os << ", ";
    }
    os << '"' << name_of(static_cast<Variant>(key.second)) << "\": {\"calls\": " << t.calls
       << ", \"failures\": " << t.failures << ", \"bytes\": " << t.bytes << ", \"time_s\": " << t.seconds << '}';
  }
  os << (open_collective < 0 ? "" : "}") << "}, \"verify\": {\"every\": " << verify_every_
     << ", \"verified\": " << verified_ << ", \"mismatches\": " << mismatches_ << "}, \"last\": ";
  if (last_.id) record_json(os, last_, now);
  else os << "null";
  os << '}';
  return os.str();
}

std::string Recorder::dump_json(const Who& who, const std::string& reason) const {
  std::ostringstream os;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  os << "{\"format\": \"pycomm.flight_recorder/1\", ";
  who_json(os, who);
  os << ", \"pid\": " << getpid() << ", \"host\": ";
  json_string(os, host);
  os << ", \"reason\": ";
  json_string(os, reason);
  os << ", \"dumped_unix_us\": " << unix_us_now() << ", \"capacity\": " << capacity_ << ", \"entries\": [";
  const uint64_t oldest = next_id_ - recent_.size() + 1;
  for (uint64_t id = oldest; id <= next_id_ && !recent_.empty(); ++id) {
    os << (id == oldest ? "\n  " : ",\n  ");
    record_json(os, recent_[(id - 1) % capacity_], now);
  }
  os << "]}\n";
  return os.str();
}

std::string Recorder::dump(const Who& who, const std::string& reason, const std::string& dir,
                           const std::string& path) const {
  std::string file = path;
  if (file.empty()) {
    std::string group = who.group;
    for (char& c : group)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') c = '_';
    file = dir + "/pycomm-flight-recorder-" + group + "-rank" + std::to_string(who.rank) + "-pid" +
           std::to_string(getpid()) + ".json";
  }
  if (!write_file_atomically(file, dump_json(who, reason)))
    fail(ErrorKind::InvalidArgument, errno_message("pycomm: cannot write the flight recorder to " + file));
  return file;
}

bool write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) return false;
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !written || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace pycomm
