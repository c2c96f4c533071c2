// A Store shared by processes through a directory, for tests whose ranks span several
// processes: one file per key (written to a temporary name, then renamed, so a reader
// sees a whole value or none), waits that poll every millisecond, and add() under an
// exclusive lock of the key's file. Keys are hex-encoded into file names.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/store.h"

namespace pycomm_test {

class FileStore final : public pycomm::Store {
 public:
  FileStore(std::string dir, std::chrono::milliseconds timeout) : dir_(std::move(dir)), timeout_(timeout) {}

  void set(const std::string& key, const std::string& value) override {
    const std::string tmp = path(key) + ".tmp" + std::to_string(getpid()) + "-" +
                            std::to_string(std::hash<std::thread::id>()(std::this_thread::get_id()));
    std::ofstream(tmp, std::ios::binary) << value;
    if (::rename(tmp.c_str(), path(key).c_str()) != 0)
      pycomm::fail(pycomm::ErrorKind::Internal, "FileStore: cannot write '" + key + "'");
  }

  std::string get(const std::string& key) override {
    if (!wait({key}, timeout_))
      pycomm::fail(pycomm::ErrorKind::Timeout, "FileStore: timed out waiting for key '" + key + "'");
    return read(key);
  }

  int64_t add(const std::string& key, int64_t delta) override {
    const int fd = ::open((path(key) + ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 || ::flock(fd, LOCK_EX) != 0)
      pycomm::fail(pycomm::ErrorKind::Internal, "FileStore: cannot lock '" + key + "'");
    const std::string old = check(key) ? read(key) : "";
    const int64_t v = (old.empty() ? 0 : std::stoll(old)) + delta;
    set(key, std::to_string(v));
    ::close(fd);  // releases the lock
    return v;
  }

  bool wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (const auto& k : keys)
      while (!check(k)) {
        if (std::chrono::steady_clock::now() >= until) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    return true;
  }

  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    std::vector<std::string> values;
    for (const auto& k : keys) values.push_back(read(k));
    return values;
  }

  bool check(const std::string& key) override { return ::access(path(key).c_str(), F_OK) == 0; }

 private:
  std::string path(const std::string& key) const {
    static const char* hex = "0123456789abcdef";
    std::string name;
    for (unsigned char c : key) name += {hex[c >> 4], hex[c & 15]};
    return dir_ + "/" + name;
  }
  std::string read(const std::string& key) const {
    std::ifstream in(path(key), std::ios::binary);
    if (!in) pycomm::fail(pycomm::ErrorKind::Timeout, "FileStore: no key '" + key + "'");
    std::ostringstream os;
    os << in.rdbuf();
    return os.str();
  }

  std::string dir_;
  std::chrono::milliseconds timeout_;
};

}  // namespace pycomm_test
