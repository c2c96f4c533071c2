// The path of collectives on one CUDA device's memory: its ops, CUDA IPC channels to the
// ranks of this host, frames staged through the host channels to the others, and the
// device team where the whole group shares the host. Point-to-point uses the ops alone.
#include "core/error.h"
#include "runtime/communicator.h"
#include "runtime/device_runtime.h"

namespace pycomm {

void Communicator::use_device(Context& cx, const Request& rq) {
  if (rq.collective == Collective::Send || rq.collective == Collective::Recv) {
    cx.ops = &device_ops(rq.device);
    return;
  }
  DevicePath& d = device_path(rq.device);
  cx.ops = &d.ops;
  cx.channels = &d.channels;
  cx.chunk_bytes = d.chunk_bytes;
  cx.workspace = &d.workspace;
  cx.device_team = d.team.get();
}

const DeviceOps& Communicator::device_ops(int device) {
  std::lock_guard<std::mutex> lock(devices_mutex_);
  std::unique_ptr<DeviceOps>& ops = device_ops_[device];
  if (!ops) ops = device_runtime().make_ops(device);
  return *ops;
}

// Every rank makes its path in the same collective (its first on CUDA tensors), so the
// store keys of the n-th path made in this group agree whichever device each rank uses.
Communicator::DevicePath& Communicator::device_path(int device) {
  {
    std::lock_guard<std::mutex> lock(devices_mutex_);
    const auto it = devices_.find(device);
    if (it != devices_.end()) return *it->second;
  }
  const DeviceRuntime& runtime = device_runtime();
  auto path = std::make_unique<DevicePath>(device_ops(device));
  TransportSetup setup;
  setup.store = store_;
  setup.key_prefix = prefix_ + "/device/" + std::to_string(devices_.size());
  setup.rank = rank_;
  setup.size = size_;
  setup.ranks = ranks_;
  setup.config = &config_;
  setup.chunk_bytes = config_.cuda_chunk_bytes;
  setup.spin = spin_;
  setup.deadline = Deadline::after(timeout_);
  bool staged_on_host = group_uses_tcp_;  // some pair's frames go through the host channels
  setup.peers = mapped_peers(runtime, device, setup.key_prefix, setup.deadline, staged_on_host);
  if (!setup.peers.empty()) path->ipc = make_shm_transport(setup, nullptr, runtime.make_slot_arena(device));
  if (path->ipc && setup.peers.size() + 1 == static_cast<size_t>(size_) && config_.cuda_flag_bytes)
    path->team = runtime.make_team(device, setup);
  path->channels.assign(size_, nullptr);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Channel* ipc = path->ipc ? path->ipc->channel(p) : nullptr;
    if (!ipc) path->staged.push_back(make_staged_channel(*channels_[p], path->ops));
    path->channels[p] = ipc ? ipc : path->staged.back().get();
  }
  // The same on every rank: the smallest slot of any channel in the group, the host
  // channels' frame where some pair is staged through them.
  path->chunk_bytes = staged_on_host ? std::min(config_.cuda_chunk_bytes, chunk_bytes_) : config_.cuda_chunk_bytes;
  if (config_.log_level >= LogLevel::Info)
    log_line("pycomm: group '" + group_name_ + "' rank " + std::to_string(rank_) + ": " + runtime.name() + ":" +
             std::to_string(device) + ": " + std::to_string(setup.peers.size()) + " peers over " +
             (path->ipc ? path->ipc->name() : "-") + ", " + std::to_string(path->staged.size()) +
             " staged through host memory, chunk " + std::to_string(path->chunk_bytes) + " B" +
             (path->team ? ", flag-synchronized one-shot up to " + std::to_string(path->team->capacity()) + " B" : ""));
  std::lock_guard<std::mutex> lock(devices_mutex_);
  return *devices_.emplace(device, std::move(path)).first->second;
}

// Which peers' device memory this rank maps, and they its, so that their frames can go
// over CUDA IPC: the ranks of this host, where both devices let a process map the other's
// memory. Not where each process sees only its own GPU (CUDA_VISIBLE_DEVICES set per rank,
// as many launchers do) or the devices lack peer access: those pairs are staged through
// host memory, as across hosts, and no call fails for it. Every rank maps a small probe
// of each peer's memory, then all publish what they mapped, so the answer is the same on
// every rank; the probes are freed once all have answered. Rank 0 says once which pairs
// are staged, and stats()["setup"] says it on every rank; `any_staged` is set where any is.
std::vector<int> Communicator::mapped_peers(const DeviceRuntime& runtime, int device, const std::string& prefix,
                                            const Deadline& deadline, bool& any_staged) {
  constexpr size_t kProbeBytes = 4096;
  const auto same_host = [&](int a, int b) { return a != b && ranks_[a].shares_host_with(ranks_[b]); };
  bool any_pair = false;
  for (int a = 0; a < size_; ++a)
    for (int b = 0; b < size_; ++b) any_pair |= same_host(a, b);
  if (!any_pair || config_.transport == TransportChoice::Tcp) return {};
  std::string why;  // the first failure to map, where this rank had one
  std::string mapped(size_, '0');  // mapped[p] == '1': this rank mapped p's memory
  std::unique_ptr<SlotArena> probe;
  if (config_.cuda_ipc == CudaIpc::Off) {
    why = "PYCOMM_CUDA_IPC=off";
  } else {
    probe = runtime.make_slot_arena(device);
    const std::vector<std::string> handles =
        all_gather_strings(*store_, prefix + "/probe", rank_, size_, probe->allocate(kProbeBytes), deadline);
    for (int p = 0; p < size_; ++p) {
      if (!same_host(rank_, p)) continue;
      try {
        probe->map(handles[p], p);
        mapped[p] = '1';
      } catch (const Error& e) {
        if (why.empty()) why = "on rank " + std::to_string(rank_) + ": " + e.what();
      }
    }
  }
  const std::vector<std::string> answers =
      all_gather_strings(*store_, prefix + "/mapped", rank_, size_, mapped + why, deadline);
  std::vector<int> peers;
  std::string staged, reason;
  for (int a = 0; a < size_; ++a)
    for (int b = a + 1; b < size_; ++b) {
      if (!same_host(a, b)) continue;
      if (answers[a][b] == '1' && answers[b][a] == '1') {
        if (a == rank_ || b == rank_) peers.push_back(a == rank_ ? b : a);
        continue;
      }
      staged += (staged.empty() ? "" : ", ") + std::to_string(a) + "-" + std::to_string(b);
      if (reason.empty())
        reason = answers[a].size() > static_cast<size_t>(size_) ? answers[a].substr(size_) : answers[b].substr(size_);
    }
  if (!staged.empty()) {
    any_staged = true;
    const std::string note = std::string(runtime.name()) + ":" + std::to_string(device) + ": rank pairs " + staged +
                             " staged through host memory, their device memory not mapped (" + reason + ")";
    if (rank_ == 0 && config_.log_level >= LogLevel::Warn) log_line("pycomm: group '" + group_name_ + "': " + note);
    std::lock_guard<std::mutex> lock(devices_mutex_);
    device_fallbacks_ += (device_fallbacks_.empty() ? "" : "; ") + note;
  }
  return peers;
}

size_t Communicator::device_team_bytes(int device) const {
  std::lock_guard<std::mutex> lock(devices_mutex_);
  const auto it = devices_.find(device);
  return it != devices_.end() && it->second->team ? it->second->team->capacity() : 0;
}

}  // namespace pycomm
