// The torch-free core at cluster scale over TCP on loopback: PYCOMM_SCALE_RANKS ranks
// (default 128) as threads of one process, every rank a Communicator with its own TCP
// transport. Steps, each timed: group creation; an all-to-all burst in which every pair
// that was not connected at creation connects at the same moment (about n peers dialling
// each rank at once); twoshot and tree all-reduces, whose results must be exact; then the
// descriptors and threads per rank. A full mesh of 128 ranks in one process holds about
// 16k sockets, under this machine's limit of 20000 descriptors per process; larger worlds
// run as PYCOMM_SCALE_PROCESSES processes (256 as 4 of 64), which rendezvous through
// a FileStore.
// Exit status 0 when every check passed. Built and run by `make test` (target core-test).
#include <dirent.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "barrier.h"
#include "check.h"
#include "file_store.h"
#include "memory_store.h"
#include "runtime/communicator.h"

using namespace pycomm;

namespace {

int entries(const char* dir) {
  int n = 0;
  if (DIR* d = opendir(dir)) {
    while (const dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Phase timings: the slowest rank's, each rank timing from a common start.
class Phases {
 public:
  explicit Phases(int n) : n_(n), start_(std::chrono::steady_clock::now()) {}
  void done(int phase) {
    const double t = seconds(std::chrono::steady_clock::now() - start_);
    std::lock_guard<std::mutex> lk(mu_);
    if (static_cast<int>(last_.size()) <= phase) last_.resize(phase + 1, 0.0);
    last_[phase] = std::max(last_[phase], t);
  }
  double at(int phase) const { return last_[phase]; }

 private:
  int n_;
  std::chrono::steady_clock::time_point start_;
  std::mutex mu_;
  std::vector<double> last_;
};

float contribution(int rank, size_t i) { return static_cast<float>((rank * 131 + i * 7) % 64); }

// Runs ranks [first, first + local) of a group of `n` as threads of this process, over
// `store`, and prints what this process measured.
void run_scale(pycomm::Store& store, int n, int first, int local) {
  constexpr size_t kCount = 4099;  // float32: odd, not divisible by the world size
  const int fds_before = entries("/proc/self/fd"), threads_before = entries("/proc/self/task");
  int fds_after_creation = 0, fds_after_burst = 0, threads_at_end = 0;
  Barrier created(local), burst(local), measured(local);
  Phases phases(local);
  std::vector<std::thread> threads;
  for (int r = first; r < first + local; ++r)
    threads.emplace_back([&, r] {
      try {
        Config config = Config::from_env();
        config.transport = TransportChoice::Tcp;
        config.tcp_chunk_bytes = 4096;
        config.pipeline_depth = 2;
        Communicator comm(store, r, n, "scale", std::chrono::seconds(120), config);
        const auto run = [&](Request rq) {
          comm.validate(rq);
          comm.execute(rq);
        };
        phases.done(0);
        if (created.wait()) fds_after_creation = entries("/proc/self/fd");
        created.wait();
        // Every rank sends one element to every other: each rank's n - 1 - 2 log2(n)
        // unconnected pairs connect at once.
        std::vector<int32_t> out(n), in(n);
        for (int p = 0; p < n; ++p) out[p] = r * 1000 + p;
        Request a2a;
        a2a.collective = Collective::AllToAll;
        a2a.dtype = DataType::Int32;
        a2a.input = out.data();
        a2a.output = in.data();
        a2a.count = n;
        a2a.send_counts.assign(n, 1);
        a2a.recv_counts.assign(n, 1);
        run(a2a);
        for (int p = 0; p < n; ++p) CHECK(in[p] == p * 1000 + r, "all-to-all at rank %d from %d: %d", r, p, in[p]);
        phases.done(1);
        if (burst.wait()) fds_after_burst = entries("/proc/self/fd");
        burst.wait();
        for (Algorithm algo : {Algorithm::TwoShot, Algorithm::Tree}) {
          std::vector<float> buf(kCount);
          for (size_t i = 0; i < kCount; ++i) buf[i] = contribution(r, i);
          Request ar;
          ar.collective = Collective::AllReduce;
          ar.input = ar.output = buf.data();
          ar.count = kCount;
          ar.options.algorithm = algo;
          run(ar);
          size_t wrong = 0;
          for (size_t i = 0; i < kCount; ++i) {
            float sum = 0;  // integers below 2^24: exact in any order
            for (int p = 0; p < n; ++p) sum += contribution(p, i);
            wrong += buf[i] != sum;
          }
          CHECK(wrong == 0, "%s all-reduce at rank %d: %zu wrong", name_of(algo), r, wrong);
          phases.done(algo == Algorithm::TwoShot ? 2 : 3);
        }
        if (measured.wait()) threads_at_end = entries("/proc/self/task");
        measured.wait();
      } catch (const std::exception& e) {
        CHECK(false, "rank %d of %d: %s", r, n, e.what());
      }
    });
  for (auto& t : threads) t.join();
  std::printf("  ranks %d-%d of %d over TCP: created in %.2f s, all-to-all burst %.2f s, twoshot %.2f s, tree %.2f s\n",
              first, first + local - 1, n, phases.at(0), phases.at(1) - phases.at(0), phases.at(2) - phases.at(1),
              phases.at(3) - phases.at(2));
  std::printf("  per rank: %.1f descriptors after creation, %.1f after the burst, %.1f threads\n",
              static_cast<double>(fds_after_creation - fds_before) / local,
              static_cast<double>(fds_after_burst - fds_before) / local,
              static_cast<double>(threads_at_end - threads_before) / local);
  std::fflush(stdout);
}

// `processes` children of this process, each running n / processes ranks, rendezvous
// through a FileStore; each is killed at the deadline, and with this process.
void run_processes(int n, int processes) {
  char dir[] = "/tmp/pycomm-scale-XXXXXX";
  if (!mkdtemp(dir)) {
    CHECK(false, "mkdtemp: %s", std::strerror(errno));
    return;
  }
  std::vector<pid_t> children;
  for (int k = 0; k < processes; ++k) {
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      pycomm_test::FileStore store(dir, std::chrono::seconds(120));
      run_scale(store, n, k * (n / processes), n / processes);
      _exit(failures ? 1 : 0);
    }
    children.push_back(pid);
  }
  int failed = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
  for (size_t left = children.size(); left > 0;) {
    for (pid_t& pid : children) {
      int status = 0;
      if (pid > 0 && waitpid(pid, &status, WNOHANG) == pid) {
        failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        pid = 0;
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() >= deadline) {
      CHECK(false, "%zu of %d processes still running at the deadline: killed", left, processes);
      for (pid_t pid : children)
        if (pid > 0) kill(pid, SIGKILL), waitpid(pid, nullptr, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(failed == 0, "%d of %d processes failed", failed, processes);
  if (DIR* d = opendir(dir)) {
    while (const dirent* e = readdir(d))
      if (e->d_name[0] != '.') unlink((std::string(dir) + "/" + e->d_name).c_str());
    closedir(d);
  }
  rmdir(dir);
}

}  // namespace

int main() {
  const auto knob = [](const char* name, int fallback) {
    const char* v = std::getenv(name);
    return v && *v ? std::atoi(v) : fallback;
  };
  const int n = knob("PYCOMM_SCALE_RANKS", 128), processes = knob("PYCOMM_SCALE_PROCESSES", 1);
  if (processes <= 1) {
    pycomm_test::MemoryStore store;
    run_scale(store, n, 0, n);
  } else {
    run_processes(n, processes);
  }
  std::printf("test_scale: %s (%d failures)\n", failures ? "FAILED" : "ok", failures);
  return failures ? 1 : 0;
}
