// Unit tests of the algorithm selection alone: a pure function, no communication.
// Built and run by `make test` (target core-test).
#include <cstdio>
#include <string>
#include <vector>

#include "core/selection.h"
#include "check.h"

using namespace pycomm;


// `nodes` nodes of `per_node` ranks, numbered node by node.
static Topology uniform(int nodes, int per_node) {
  std::vector<int> node_of;
  for (int n = 0; n < nodes; ++n)
    for (int l = 0; l < per_node; ++l) node_of.push_back(n);
  return Topology::from_node_of(node_of);
}

// Shared memory: 2 us, 8 GB/s; TCP between nodes: 30 us, 0.125 GB/s (1 Gbit/s).
static SelectionInput input(const Topology& t, size_t bytes, Collective c = Collective::AllReduce,
                            Algorithm requested = Algorithm::Auto) {
  SelectionInput in;
  in.collective = c;
  in.bytes = bytes;
  in.topology = &t;
  in.requested = requested;
  in.costs.intra = {2.0, 8000.0};
  in.costs.inter = {30.0, 125.0};
  return in;
}

static const char* chosen(const SelectionInput& in) { return name_of(select_algorithm(in).algorithm); }

static void test_requested_algorithm_is_honoured_where_it_serves() {
  const Topology one = uniform(1, 4), two = uniform(2, 2);
  for (Algorithm a : {Algorithm::Ring, Algorithm::Tree, Algorithm::OneShot, Algorithm::TwoShot}) {
    const Selection s = select_algorithm(input(one, 1 << 20, Collective::AllReduce, a));
    CHECK(s.algorithm == a && s.fallback.empty(), "%s on one node", name_of(a));
  }
  const Selection h = select_algorithm(input(two, 1 << 20, Collective::AllReduce, Algorithm::Hierarchical));
  CHECK(h.algorithm == Algorithm::Hierarchical && h.fallback.empty(), "hierarchical on two nodes");
  const Selection rs = select_algorithm(input(one, 1 << 20, Collective::ReduceScatter, Algorithm::OneShot));
  CHECK(rs.algorithm == Algorithm::OneShot && rs.fallback.empty(), "oneshot reduce-scatter");
}

static void test_fallback_says_why() {
  const Topology one = uniform(1, 4);
  const Selection h = select_algorithm(input(one, 1 << 20, Collective::AllReduce, Algorithm::Hierarchical));
  CHECK(h.algorithm != Algorithm::Hierarchical, "hierarchical must not run on one node");
  CHECK(h.fallback.find("more than one node") != std::string::npos, "fallback: %s", h.fallback.c_str());
  const Selection auto_choice = select_algorithm(input(one, 1 << 20));
  CHECK(h.algorithm == auto_choice.algorithm, "fallback is the automatic choice");

  const Topology uneven = Topology::from_node_of({0, 0, 1});
  const Selection u = select_algorithm(input(uneven, 1 << 20, Collective::AllReduce, Algorithm::Hierarchical));
  CHECK(u.algorithm != Algorithm::Hierarchical && u.fallback.find("same number") != std::string::npos,
        "uneven nodes: %s", u.fallback.c_str());

  const Selection t = select_algorithm(input(one, 1 << 20, Collective::AllGather, Algorithm::Tree));
  CHECK(t.algorithm != Algorithm::Tree && t.fallback.find("allreduce only") != std::string::npos,
        "tree all-gather: %s", t.fallback.c_str());
}

static void test_auto_choices() {
  const Topology one = uniform(1, 4), pair = uniform(1, 2), two = uniform(2, 2);
  // One host: small messages take one step, large ones the least traffic per rank.
  CHECK(std::string(chosen(input(one, 4096))) == "oneshot", "4 KiB on one node: %s", chosen(input(one, 4096)));
  CHECK(std::string(chosen(input(one, 64 << 20))) == "twoshot", "64 MiB on one node: %s",
        chosen(input(one, 64 << 20)));
  // Two ranks: one step while latency dominates, the least memory traffic for large ones.
  CHECK(std::string(chosen(input(pair, 64 << 20))) == "twoshot", "64 MiB on two ranks: %s",
        chosen(input(pair, 64 << 20)));
  CHECK(std::string(chosen(input(pair, 4096))) == "oneshot", "4 KiB on two ranks: %s", chosen(input(pair, 4096)));
  // Two nodes behind a slow link: hierarchical for large messages.
  CHECK(std::string(chosen(input(two, 64 << 20))) == "hierarchical", "64 MiB on two nodes: %s",
        chosen(input(two, 64 << 20)));
  // Reduce-scatter and all-gather choose between ring and direct only.
  for (Collective c : {Collective::ReduceScatter, Collective::AllGather}) {
    const std::string a = chosen(input(one, 4096, c));
    CHECK(a == "ring" || a == "oneshot", "%s: %s", name_of(c), a.c_str());
  }
}

static void test_costs_drive_the_choice() {
  // The same request flips with the measured link costs: one-shot while latency dominates,
  // two-shot once the link is slow enough that bytes dominate.
  const Topology one = uniform(1, 4);
  SelectionInput in = input(one, 256 << 10);
  in.costs.intra = {1000.0, 8000.0};
  const std::string slow_latency = chosen(in);
  in.costs.intra = {0.5, 100.0};
  const std::string slow_bandwidth = chosen(in);
  CHECK(slow_latency == "oneshot" && slow_bandwidth == "twoshot", "latency-bound %s, bandwidth-bound %s",
        slow_latency.c_str(), slow_bandwidth.c_str());
  // Two-shot moves what a ring moves in fewer dependent hops: never worse on one node.
  for (size_t bytes : {size_t{4096}, size_t{1} << 20, size_t{64} << 20})
    CHECK(predicted_us(Algorithm::TwoShot, input(one, bytes)) <= predicted_us(Algorithm::Ring, input(one, bytes)),
          "two-shot vs ring at %zu B", bytes);
  // Predictions grow with size.
  for (Algorithm a : {Algorithm::Ring, Algorithm::Tree, Algorithm::OneShot, Algorithm::TwoShot})
    CHECK(predicted_us(a, input(one, 1 << 20)) < predicted_us(a, input(one, 64 << 20)), "%s grows", name_of(a));
}

static void test_single_rank() {
  const Topology solo = uniform(1, 1);
  CHECK(select_algorithm(input(solo, 1 << 20)).fallback.empty(), "one rank needs no fallback");
  std::string why;
  CHECK(!serves(Algorithm::Hierarchical, Collective::AllReduce, solo, &why) && !why.empty(), "one rank: %s",
        why.c_str());
}

// Deterministic modes need every element reduced by one rank from all contributions:
// tree and hierarchical (partial sums grouped by their shape) fall back, saying why.
static void test_deterministic_modes() {
  const Topology two = uniform(2, 2);
  for (Determinism d : {Determinism::Ordered, Determinism::Exact}) {
    for (Algorithm a : {Algorithm::Tree, Algorithm::Hierarchical}) {
      SelectionInput in = input(two, 64 << 20, Collective::AllReduce, a);
      in.determinism = d;
      const Selection s = select_algorithm(in);
      CHECK(s.algorithm != Algorithm::Tree && s.algorithm != Algorithm::Hierarchical &&
                s.fallback.find("deterministic") != std::string::npos,
            "%s in a deterministic mode: chose %s (%s)", name_of(a), name_of(s.algorithm), s.fallback.c_str());
    }
    for (size_t bytes : {size_t{64}, size_t{64} << 20}) {  // auto never picks them either
      SelectionInput in = input(two, bytes);
      in.determinism = d;
      const Algorithm a = select_algorithm(in).algorithm;
      CHECK(a != Algorithm::Tree && a != Algorithm::Hierarchical, "auto picked %s", name_of(a));
    }
  }
  CHECK(serves(Algorithm::Ring, Collective::AllReduce, uniform(2, 2), nullptr, Determinism::Exact), "ring serves");
}

// Device memory on one node: the direct algorithms at every size; requests still rule,
// and several nodes go by the cost model.
static void test_device_memory() {
  const Topology one = uniform(1, 4), two = uniform(2, 2);
  for (size_t bytes : {size_t{4} << 10, kDeviceOneShotBytes, size_t{64} << 20}) {
    SelectionInput in = input(one, bytes);
    in.device_memory = true;
    const Algorithm want = bytes > kDeviceOneShotBytes ? Algorithm::TwoShot : Algorithm::OneShot;
    CHECK(select_algorithm(in).algorithm == want, "device all-reduce of %zu B: %s", bytes, chosen(in));
    for (Collective c : {Collective::ReduceScatter, Collective::AllGather}) {
      in.collective = c;
      CHECK(select_algorithm(in).algorithm == Algorithm::OneShot, "device %s: %s", name_of(c), chosen(in));
    }
  }
  SelectionInput ring = input(one, 64 << 20, Collective::AllReduce, Algorithm::Ring);
  ring.device_memory = true;
  CHECK(select_algorithm(ring).algorithm == Algorithm::Ring, "device: a requested ring runs");
  SelectionInput nodes = input(two, 64 << 20);
  SelectionInput host = nodes;
  nodes.device_memory = true;
  CHECK(select_algorithm(nodes).algorithm == select_algorithm(host).algorithm, "device on 2 nodes: the cost model");
}

int main() {
  test_requested_algorithm_is_honoured_where_it_serves();
  test_device_memory();
  test_deterministic_modes();
  test_fallback_says_why();
  test_auto_choices();
  test_costs_drive_the_choice();
  test_single_rank();
  if (failures) std::fprintf(stderr, "%d selection checks failed\n", failures);
  else std::printf("selection: all checks passed\n");
  return failures ? 1 : 0;
}
