// Errors of the core. The torch binding maps InvalidArgument to ValueError and every
// other kind to torch.distributed.DistBackendError. Corruption: the results of a
// collective that must be identical on every rank differ between ranks (PYCOMM_VERIFY).
#pragma once

#include <stdexcept>
#include <string>

namespace pycomm {

enum class ErrorKind { InvalidArgument, Timeout, PeerFailure, Mismatch, Corruption, Internal };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

[[noreturn]] inline void fail(ErrorKind kind, const std::string& what) { throw Error(kind, what); }

// Describes a system call failure: "<what>: <strerror(errno)>".
std::string errno_message(const std::string& what);
// "15.0 MiB", for messages.
std::string mebibytes(double bytes);

}  // namespace pycomm
