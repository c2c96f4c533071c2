// A communicator: one group's ranks, their channels, and the execution of operations with
// sticky errors. Callers (the group's engine) run collectives one at a time, with no p2p
// in flight; p2p operations of different (peer, direction) lanes may run concurrently,
// since they touch disjoint channel directions and counters, and so may a recv from any
// source, which locks the receive side it takes frames from. abort() is thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "algorithms/algorithm.h"
#include "algorithms/p2p.h"
#include "core/config.h"
#include "core/doorbell.h"
#include "core/store.h"
#include "core/topology.h"
#include "runtime/plan.h"
#include "runtime/recorder.h"
#include "transport/transport.h"

namespace pycomm {

class DeviceRuntime;

// This process's host, as groups tell nodes apart (rendezvous.cc): equal exactly for
// processes that can map each other's shared memory and see each other's pids.
std::string host_key();
// The cores this process may run on (its affinity).
int cores_available();

class Communicator final : private SenderMatch {
 public:
  // Rendezvous through `store` (keys private to this group); blocks until every rank of
  // the group has connected, or throws. `store` must outlive the communicator: the first
  // collective on a CUDA device's memory sets up that device's channels through it.
  Communicator(Store& store, int rank, int size, std::string group_name, std::chrono::milliseconds timeout,
               Config config);
  ~Communicator();

  int rank() const { return rank_; }
  int size() const { return size_; }
  const Config& config() const { return config_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // The store keys of this group instance begin with it (distinct for every instance).
  const std::string& key_prefix() const { return prefix_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  // Rejects a malformed request on the calling thread (InvalidArgument), before anything
  // is sent. Fills in defaults from the group's configuration.
  void validate(Request& rq) const;

  // Runs `rq` to completion and returns the plan it ran. `planned`: the plan made for
  // `rq` when it was issued, which host memory's requests run as is (only a device's
  // team, set up by its first collective, can change a plan in between); null: planned
  // here. A failure poisons the communicator: the peers are told (abort) and every later
  // call fails at once with the original cause. With PYCOMM_VERIFY, every N-th
  // all-reduce, all-gather and broadcast is verified once it completed (verify()).
  Plan execute(const Request& rq, const Plan* planned = nullptr);

  // Fails every current and future wait with `reason`; safe from any thread. Returns
  // true for the call that poisoned the group (the first).
  bool abort(const std::string& reason);

  // "shm: ranks 1,2; tcp: rank 3", for logs and tests.
  std::string describe_transports() const;
  const Topology& topology() const { return topology_; }
  // What runs `rq` (identical on every rank) where the group's device team, if any, runs
  // all-reduces of up to `device_team_bytes` (see device_team_bytes()).
  Plan plan(const Request& rq, size_t device_team_bytes) const;
  // The capacity of the device team on `device`: 0 where it has none, or none yet (it is
  // made by the first collective on that device's memory).
  size_t device_team_bytes(int device) const;

  // What runs a validated request: the plan's variant (its label), the compression and
  // the determinism level, by name (static strings of the enums' tables). Identical on
  // every rank.
  struct Choices {
    const char* algorithm = "";
    const char* compression = "";
    const char* determinism = "";
  };
  static Choices choices(const Request& rq, const Plan& plan);
  // The plan as far as it is known before `rq` runs (its device team may not exist yet).
  Plan plan_before_running(const Request& rq) const;
  // A recv from `peer` with `tag` was posted: it will run on the peer's lane. Until it
  // starts, a message of its tag that arrives ahead of another recv's is held for it even
  // past the pair's limit (see p2p.h). Any thread.
  void post_recv(int peer, int tag);

  // The group's counters and flight recorder as JSON (see recorder.h); any thread.
  std::string stats_json() const;
  std::string flight_recorder_json(const std::string& reason) const;
  // Writes the flight recorder to `path` (empty: this rank's file in
  // PYCOMM_FLIGHT_RECORDER_DIR) and returns the path; throws when it cannot.
  std::string dump_flight_recorder(const std::string& reason, const std::string& path = {}) const;

 private:
  void connect(Store& store, const std::string& prefix);  // rendezvous.cc
  // "; rank 1 was claimed by 2 processes; rank 0 was started with world size 3, ...":
  // what the store shows of ranks started inconsistently (empty: nothing).
  std::string start_up_disagreements(Store& store, const std::string& prefix) const;
  void calibrate(Store& store, const std::string& prefix);  // link_costs.cc
  // Moves shm_peers to tcp_peers where shared memory has no room; rendezvous.cc.
  std::unique_ptr<ShmSegment> fit_shared_memory(Store& store, const std::string& prefix, TransportSetup& setup,
                                                std::vector<int>& shm_peers, std::vector<int>& tcp_peers);
  Context context() const;  // for host memory
  OpStamp stamp_for(const Request& rq, const Plan& plan);
  PlanInput plan_input(const Request& rq, size_t device_team_bytes) const;  // what plan() plans from
  // PYCOMM_VERIFY: hashes this rank's output of `rq`, which `cx` ran to completion, and
  // all-gathers every rank's hash (verify_plan_, over the host channels, within cx's
  // deadline, stamped as the verification of cx's operation, which keeps its sequence
  // number); a Corruption error names the ranks whose results differ from the majority's.
  // Every rank compares the same hashes, so every rank fails alike, or none.
  void verify(const Context& cx, const Request& rq);
  // Once the group has failed (poisoned(): a load, so that a call in good health builds
  // no description), fail_poisoned fails with PeerFailure, naming `operation`.
  bool poisoned() const { return poisoned_.load(std::memory_order_acquire); }
  void fail_poisoned(const std::string& operation);
  // Fails every later call with `reason`, as abort() does, but not the transports' waits;
  // returns true for the call that poisoned the group.
  bool poison(const std::string& reason);
  // A recv from kAnySource: waits for the first peer that offers a message with the recv's
  // tag (Inbox::offers), returns it with `held` locking its receive side; Timeout at the
  // deadline, a peer's failure once every peer has failed or left.
  int await_sender(const Context& cx, int tag, std::unique_lock<std::mutex>& held);
  int match(Context& recv, int tag, std::unique_lock<std::mutex>& held) override;  // SenderMatch
  // The stamp's operation as a log line: "group 'g': allreduce #3 (...)".
  std::string operation_line(const OpStamp& stamp) const;

  // What collectives on one CUDA device's memory run with: its ops, channels (CUDA IPC to
  // ranks of this host, staged through the host channels to the others) and scratch.
  // Made by the first collective on that device's tensors, which every rank reaches.
  struct DevicePath {
    const DeviceOps& ops;                          // device_ops(): outlives the path
    std::unique_ptr<Transport> ipc;                // to ranks of this host; null: none
    std::vector<std::unique_ptr<Channel>> staged;  // to the others, over the host channels
    std::vector<Channel*> channels;                // by group rank; null for self
    std::unique_ptr<DeviceTeam> team;              // the whole group on this host; null: none
    size_t chunk_bytes = 0;
    Workspace workspace;
    explicit DevicePath(const DeviceOps& o) : ops(o), workspace(o) {}
  };
  // Points `cx` at the memory of rq.device: collectives at the device's path,
  // point-to-point at its ops over the host channels (see algorithms/p2p.h). Throws what
  // setting them up throws.
  void use_device(Context& cx, const Request& rq);  // device_path.cc
  DevicePath& device_path(int device);              // device_path.cc
  // The ranks of this host whose frames on `device` go over its runtime's shared device
  // memory (the others are staged through host memory; then `any_staged` is set);
  // device_path.cc.
  std::vector<int> mapped_peers(const DeviceRuntime& runtime, int device, const std::string& prefix,
                                const Deadline& deadline, bool& any_staged);
  // The ops on `device`'s memory, made by this rank alone on first use: a point-to-point
  // operation, which its peers need not join, may be the first. Any thread: p2p lanes run
  // at once, and share them.
  const DeviceOps& device_ops(int device);  // device_path.cc
  void abort_transports(const std::string& reason) const;  // host and device, any thread

  int rank_, size_;
  std::string group_name_;
  Store* store_;
  std::string prefix_;             // of this group instance's store keys
  SpinPolicy spin_;
  bool group_uses_tcp_ = false;
  std::chrono::milliseconds timeout_;
  Config config_;
  std::vector<PeerInfo> ranks_;
  Topology topology_;
  LinkCosts costs_;            // measured, or read from PYCOMM_LINK_COSTS
  LinkCosts reference_costs_;  // reference_link_costs of rank 0's machine, or read from PYCOMM_LINK_COSTS
  // Rung for every frame that arrives and when a pair's receive side is let go: a recv
  // from any source sleeps on it. In the shm transport's segment when there is one (the
  // senders of this host ring it there), else in own_doorbell_. Outlives the transports.
  std::unique_ptr<DoorbellWord> own_doorbell_;
  Doorbell doorbell_;
  std::vector<std::unique_ptr<Transport>> transports_;  // destroyed last to first
  std::vector<Channel*> channels_;
  size_t chunk_bytes_ = 0;
  size_t shm_chunk_bytes_ = 0;  // of the shm transport's slots; 0: no shm transport in the group
  std::string shm_fallback_;    // what the group runs instead of the configured rings; empty: them
  uint64_t collective_seq_ = 0;
  uint64_t identical_results_ = 0;  // all-reduces, all-gathers and broadcasts so far (PYCOMM_VERIFY)
  Plan verify_plan_;                // of the hash exchange, where PYCOMM_VERIFY is on
  std::vector<uint64_t> sends_to_, recvs_from_;  // p2p frame stream counts per peer
  // Held by a recv while it takes frames from that peer: a recv named for the peer (its
  // lane) and a recv from any source (its own lane) may both want them. Guards the
  // peer's inbox.
  std::unique_ptr<std::mutex[]> receiving_;
  std::vector<Inbox> inboxes_;  // by peer
  std::unique_ptr<Perturbation> perturb_;        // PYCOMM_TEST_PERTURB; null when unset
  std::unique_ptr<FaultInjector> fault_;         // PYCOMM_FAULT for this rank; null when none
  std::unique_ptr<FrameTrace> frame_trace_;      // PYCOMM_DEBUG=TRACE; null otherwise
  Recorder recorder_;
  mutable Workspace workspace_{cpu_ops()};      // operations run one at a time
  mutable std::mutex devices_mutex_;              // guards device_ops_, and devices_ against abort()
  std::map<int, std::unique_ptr<DeviceOps>> device_ops_;  // before devices_, whose paths use them
  std::map<int, std::unique_ptr<DevicePath>> devices_;
  std::string device_fallbacks_;                  // the device paths' staged pairs, and why; guarded as devices_
  std::mutex poison_mutex_;
  std::string poison_;                            // guarded by poison_mutex_
  std::atomic<bool> poisoned_{false};             // poison_ is set
  // The last plan made and what it was made from: a loop of like calls plans once.
  struct PlanMemo {
    PlanInput in;
    Plan plan;
  };
  mutable std::mutex plan_memo_mutex_;
  mutable std::optional<PlanMemo> plan_memo_;      // guarded by plan_memo_mutex_
};

}  // namespace pycomm
