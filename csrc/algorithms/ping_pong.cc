// Link measurement for the cost model, run once at group creation before any collective
// (frames carry sequence number 0).
// ping_pong: between two ranks over their channel. Latency: half the median round trip of
// a 64-byte frame. Bandwidth: a 2 MiB stream answered by one small frame, best of two,
// less one latency.
// step_latency_us: every rank of a team at once, so that it includes what a lone pair
// does not see: ranks competing for cores (more ranks than cores), and waking peers.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "algorithms/algorithm.h"
#include "core/link_cost.h"

namespace pycomm {
namespace {

constexpr size_t kPingBytes = 64, kStreamBytes = 2 << 20;
constexpr int kPings = 16, kStreams = 2;

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

LinkCost ping_pong(const Context& cx, int peer, bool initiator) {
  std::vector<char> buf(kStreamBytes);
  const auto ping = [&] { send_bytes(cx, peer, buf.data(), kPingBytes); };
  const auto pong = [&] { recv_bytes(cx, peer, buf.data(), kPingBytes); };
  std::vector<double> rtts;
  for (int i = 0; i < kPings; ++i) {
    const double t0 = now_us();
    if (initiator) {
      ping();
      pong();
    } else {
      pong();
      ping();
    }
    rtts.push_back(now_us() - t0);
  }
  std::nth_element(rtts.begin(), rtts.begin() + kPings / 2, rtts.end());
  LinkCost cost;
  cost.latency_us = rtts[kPings / 2] / 2;
  double best = INFINITY;
  for (int i = 0; i < kStreams; ++i) {
    const double t0 = now_us();
    if (initiator) {
      send_bytes(cx, peer, buf.data(), kStreamBytes);
      pong();
    } else {
      recv_bytes(cx, peer, buf.data(), kStreamBytes);
      ping();
    }
    best = std::min(best, now_us() - t0);
  }
  cost.bytes_per_us = kStreamBytes / std::max(best - 2 * cost.latency_us, 1.0);
  return cost;
}

double step_latency_us(const Context& team) {
  constexpr int kBarriers = 16;
  int rounds = 0;
  for (int d = 1; d < team.size; d <<= 1) ++rounds;
  const Request none;
  dissemination_barrier(team, none);  // everyone has arrived
  const double t0 = now_us();
  for (int i = 0; i < kBarriers; ++i) dissemination_barrier(team, none);
  return (now_us() - t0) / (kBarriers * std::max(rounds, 1));
}

}  // namespace pycomm
