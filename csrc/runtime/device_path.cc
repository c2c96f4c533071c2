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
  for (const PeerInfo& p : ranks_)
    if (p.rank != rank_ && p.shares_host_with(ranks_[rank_]) && config_.transport != TransportChoice::Tcp)
      setup.peers.push_back(p.rank);
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
  // The same on every rank: the smallest slot of any channel in the group.
  path->chunk_bytes = group_uses_tcp_ ? std::min(config_.cuda_chunk_bytes, config_.tcp_chunk_bytes)
                                      : config_.cuda_chunk_bytes;
  if (config_.log_level >= LogLevel::Info)
    log_line("pycomm: group '" + group_name_ + "' rank " + std::to_string(rank_) + ": " + runtime.name() + ":" +
             std::to_string(device) + ": " + std::to_string(setup.peers.size()) + " peers over " +
             (path->ipc ? path->ipc->name() : "-") + ", " + std::to_string(path->staged.size()) +
             " staged through host memory, chunk " + std::to_string(path->chunk_bytes) + " B" +
             (path->team ? ", flag-synchronized one-shot up to " + std::to_string(path->team->capacity()) + " B"
                         : ""));
  std::lock_guard<std::mutex> lock(devices_mutex_);
  return *devices_.emplace(device, std::move(path)).first->second;
}


size_t Communicator::device_team_bytes(int device) const {
  std::lock_guard<std::mutex> lock(devices_mutex_);
  const auto it = devices_.find(device);
  return it != devices_.end() && it->second->team ? it->second->team->capacity() : 0;
}

}  // namespace pycomm
