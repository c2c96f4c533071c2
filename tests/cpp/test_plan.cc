// Unit tests of the plan alone (what runs a call, its label, its predicted cost): a pure
// function, no communication. Built and run by `make test` (target core-test).
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "check.h"
#include "runtime/plan.h"

using namespace pycomm;

// `nodes` nodes of `per_node` ranks, numbered node by node.
static Topology uniform(int nodes, int per_node) {
  std::vector<int> node_of;
  for (int n = 0; n < nodes; ++n)
    for (int l = 0; l < per_node; ++l) node_of.push_back(n);
  return Topology::from_node_of(node_of);
}

// Shared memory: 2 us, 8 GB/s; TCP between nodes: 30 us, 0.125 GB/s (1 Gbit/s).
static PlanInput input(const Topology& t, size_t bytes, Collective c = Collective::AllReduce,
                       Algorithm requested = Algorithm::Auto) {
  PlanInput in;
  in.collective = c;
  in.bytes = bytes;
  in.topology = &t;
  in.options.algorithm = requested;
  in.network = t.node_count() > 1;  // nodes talk over TCP
  in.costs.intra = {2.0, 8000.0};
  in.costs.inter = {30.0, 125.0};
  in.reference_costs = in.costs;
  return in;
}

static const char* chosen(const PlanInput& in) { return name_of(make_plan(in).algorithm); }
static const char* label(const PlanInput& in) { return name_of(make_plan(in).variant); }
static double predicted_us(Algorithm a, const PlanInput& in) {
  Plan p;
  return plan_family(a, in, &p) ? p.predicted_us : INFINITY;
}

static void test_requested_algorithm_is_honoured_where_it_serves() {
  const Topology one = uniform(1, 4), two = uniform(2, 2);
  for (Algorithm a : {Algorithm::Ring, Algorithm::Tree, Algorithm::OneShot, Algorithm::TwoShot}) {
    const Plan s = make_plan(input(one, 1 << 20, Collective::AllReduce, a));
    CHECK(s.algorithm == a && s.fallback.empty(), "%s on one node", name_of(a));
  }
  const Plan h = make_plan(input(two, 1 << 20, Collective::AllReduce, Algorithm::Hierarchical));
  CHECK(h.algorithm == Algorithm::Hierarchical && h.fallback.empty(), "hierarchical on two nodes");
  const Plan rs = make_plan(input(one, 1 << 20, Collective::ReduceScatter, Algorithm::OneShot));
  CHECK(rs.algorithm == Algorithm::OneShot && rs.fallback.empty(), "oneshot reduce-scatter");
}

static void test_fallback_says_why() {
  const Topology one = uniform(1, 4);
  const Plan h = make_plan(input(one, 1 << 20, Collective::AllReduce, Algorithm::Hierarchical));
  CHECK(h.algorithm != Algorithm::Hierarchical, "hierarchical must not run on one node");
  CHECK(h.fallback.find("more than one node") != std::string::npos, "fallback: %s", h.fallback.c_str());
  const Plan auto_choice = make_plan(input(one, 1 << 20));
  CHECK(h.algorithm == auto_choice.algorithm, "fallback is the automatic choice");

  const Topology uneven = Topology::from_node_of({0, 0, 1});
  const Plan u = make_plan(input(uneven, 1 << 20, Collective::AllReduce, Algorithm::Hierarchical));
  CHECK(u.algorithm != Algorithm::Hierarchical && u.fallback.find("same number") != std::string::npos,
        "uneven nodes: %s", u.fallback.c_str());

  const Plan t = make_plan(input(one, 1 << 20, Collective::AllGather, Algorithm::TwoShot));
  CHECK(t.algorithm != Algorithm::TwoShot && t.fallback.find("allreduce only") != std::string::npos,
        "twoshot all-gather: %s", t.fallback.c_str());
}

static void test_auto_choices() {
  const Topology one = uniform(1, 4), pair = uniform(1, 2), two = uniform(2, 2);
  // One host: small messages take one step, large ones the least traffic per rank.
  CHECK(std::string(chosen(input(one, 4096))) == "oneshot", "4 KiB on one node: %s", chosen(input(one, 4096)));
  CHECK(std::string(chosen(input(one, 64 << 20))) == "twoshot", "64 MiB on one node: %s", chosen(input(one, 64 << 20)));
  // Two ranks: one step while latency dominates, the least memory traffic for large ones.
  CHECK(std::string(chosen(input(pair, 64 << 20))) == "twoshot", "64 MiB on two ranks: %s",
        chosen(input(pair, 64 << 20)));
  CHECK(std::string(chosen(input(pair, 4096))) == "oneshot", "4 KiB on two ranks: %s", chosen(input(pair, 4096)));
  // Two nodes behind a slow link: hierarchical for large messages.
  CHECK(std::string(chosen(input(two, 64 << 20))) == "hierarchical", "64 MiB on two nodes: %s",
        chosen(input(two, 64 << 20)));
  // Reduce-scatter and all-gather: direct while latency dominates, on one node.
  for (Collective c : {Collective::ReduceScatter, Collective::AllGather})
    CHECK(std::string(label(input(one, 4096, c))) == "direct", "%s of 4 KiB: %s", name_of(c),
          label(input(one, 4096, c)));
}

static void test_costs_drive_the_choice() {
  // The same request flips with the link costs: one-shot while latency dominates,
  // two-shot once the link is slow enough that bytes dominate. Deterministic modes price
  // at the measured costs, the default mode at the reference ones alone.
  const Topology one = uniform(1, 4);
  PlanInput in = input(one, 256 << 10);
  for (Determinism mode : {Determinism::Ordered, Determinism::Default}) {
    in.options.determinism = mode;
    LinkCost& priced = (mode == Determinism::Default ? in.reference_costs : in.costs).intra;
    priced = {1000.0, 8000.0};
    const std::string slow_latency = chosen(in);
    priced = {0.5, 100.0};
    const std::string slow_bandwidth = chosen(in);
    CHECK(slow_latency == "oneshot" && slow_bandwidth == "twoshot", "%s: latency-bound %s, bandwidth-bound %s",
          name_of(mode), slow_latency.c_str(), slow_bandwidth.c_str());
  }
  // Default mode: no measurement moves the choice, since its variants add in orders of
  // their own (D1 across runs). Here the tree family's two variants, on 2 x 2 over TCP.
  const Topology two = uniform(2, 2);
  PlanInput tree = input(two, 80 << 10, Collective::AllReduce, Algorithm::Tree);
  const std::string by_reference = label(tree);
  for (LinkCost measured : {LinkCost{1.0, 100000.0}, LinkCost{5000.0, 1.0}, LinkCost{0.1, 1.0}}) {
    tree.costs.inter = tree.costs.intra = measured;
    CHECK(label(tree) == by_reference, "tree variant %s by measurement, %s by reference", label(tree),
          by_reference.c_str());
  }
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
  CHECK(make_plan(input(solo, 1 << 20)).fallback.empty(), "one rank needs no fallback");
  std::string why;
  CHECK(!plan_family(Algorithm::Hierarchical, input(solo, 1 << 20), nullptr, &why) && !why.empty(), "one rank: %s",
        why.c_str());
}

// Deterministic modes need every element reduced by one rank from all contributions:
// tree and hierarchical (partial sums grouped by their shape) fall back, saying why.
static void test_deterministic_modes() {
  const Topology two = uniform(2, 2);
  for (Determinism d : {Determinism::Ordered, Determinism::Exact}) {
    for (Algorithm a : {Algorithm::Tree, Algorithm::Hierarchical}) {
      PlanInput in = input(two, 64 << 20, Collective::AllReduce, a);
      in.options.determinism = d;
      const Plan s = make_plan(in);
      CHECK(s.algorithm != Algorithm::Tree && s.algorithm != Algorithm::Hierarchical &&
                s.fallback.find("deterministic") != std::string::npos,
            "%s in a deterministic mode: chose %s (%s)", name_of(a), name_of(s.algorithm), s.fallback.c_str());
    }
    for (size_t bytes : {size_t{64}, size_t{64} << 20}) {  // auto never picks them either
      PlanInput in = input(two, bytes);
      in.options.determinism = d;
      const Algorithm a = make_plan(in).algorithm;
      CHECK(a != Algorithm::Tree && a != Algorithm::Hierarchical, "auto picked %s", name_of(a));
    }
  }
  PlanInput exact = input(two, 1 << 20, Collective::AllReduce, Algorithm::Ring);
  exact.options.determinism = Determinism::Exact;
  CHECK(plan_family(Algorithm::Ring, exact, nullptr), "ring serves exact mode");
}

// Device memory on one node: the direct algorithms at every size; requests still rule,
// and several nodes go by the cost model.
static void test_device_memory() {
  const Topology one = uniform(1, 4), two = uniform(2, 2);
  for (size_t bytes : {size_t{4} << 10, kDeviceOneShotBytes, size_t{64} << 20}) {
    PlanInput in = input(one, bytes);
    in.device_memory = true;
    const Algorithm want = bytes > kDeviceOneShotBytes ? Algorithm::TwoShot : Algorithm::OneShot;
    CHECK(make_plan(in).algorithm == want, "device all-reduce of %zu B: %s", bytes, chosen(in));
    for (Collective c : {Collective::ReduceScatter, Collective::AllGather}) {
      in.collective = c;
      CHECK(make_plan(in).algorithm == Algorithm::OneShot, "device %s: %s", name_of(c), chosen(in));
    }
  }
  // A device team pipelines an all-reduce of any size it serves: oneshot on it; past its
  // size, or compressed, twoshot again.
  for (size_t bytes : {size_t{4} << 10, size_t{1} << 20, size_t{64} << 20, (size_t{64} << 20) + 4}) {
    PlanInput in = input(one, bytes);
    in.device_memory = true;
    in.device_team_bytes = size_t{64} << 20;
    const bool fits = bytes <= in.device_team_bytes;
    CHECK(make_plan(in).variant == (fits ? Variant::OneShotFlags : Variant::TwoShot), "device team, %zu B: %s", bytes,
          chosen(in));
    in.options.compression = Compression::Fp8E4M3;
    in.options.compression_block = 256;
    CHECK(make_plan(in).variant != Variant::OneShotFlags, "device team, %zu B compressed: %s", bytes, chosen(in));
  }
  PlanInput ring = input(one, 64 << 20, Collective::AllReduce, Algorithm::Ring);
  ring.device_memory = true;
  ring.device_team_bytes = size_t{64} << 20;
  CHECK(make_plan(ring).algorithm == Algorithm::Ring, "device: a requested ring runs");
  PlanInput nodes = input(two, 64 << 20);
  PlanInput host = nodes;
  nodes.device_memory = true;
  CHECK(make_plan(nodes).algorithm == make_plan(host).algorithm, "device on 2 nodes: the cost model");
}

// The label is what runs: a family's deterministic and compressed calls run other shapes.
static void test_labels_say_what_runs() {
  const Topology one = uniform(1, 4);
  struct Case {
    Collective c;
    Algorithm a;
    Determinism d;
    Compression z;
    const char* want;
  };
  using C = Collective;
  using A = Algorithm;
  using D = Determinism;
  using Z = Compression;
  const Case cases[] = {
      {C::AllReduce, A::Ring, D::Default, Z::None, "ring"},
      {C::AllReduce, A::Ring, D::Ordered, Z::None, "direct+ring"},
      {C::AllReduce, A::Ring, D::Exact, Z::None, "direct+ring"},
      {C::AllReduce, A::Ring, D::Default, Z::Fp8E4M3, "direct+ring"},
      {C::AllReduce, A::OneShot, D::Ordered, Z::Bf16, "oneshot"},
      {C::AllReduce, A::TwoShot, D::Exact, Z::None, "twoshot"},
      {C::AllReduce, A::Tree, D::Default, Z::Fp16, "tree"},
      {C::ReduceScatter, A::Ring, D::Default, Z::None, "ring"},
      {C::ReduceScatter, A::Ring, D::Ordered, Z::None, "direct"},
      {C::ReduceScatter, A::Ring, D::Default, Z::Fp8E5M2, "direct"},
      {C::ReduceScatter, A::OneShot, D::Default, Z::None, "direct"},
      {C::AllGather, A::Ring, D::Default, Z::Fp16, "ring"},
      {C::AllGather, A::OneShot, D::Default, Z::None, "direct"},
      {C::Broadcast, A::Ring, D::Default, Z::None, "chain"},
      {C::AllToAll, A::Auto, D::Default, Z::None, "pairwise"},
      {C::Barrier, A::Auto, D::Default, Z::None, "dissemination"},
  };
  for (const Case& k : cases) {
    PlanInput in = input(one, 1 << 20, k.c, k.a);
    in.options.determinism = k.d;
    in.options.compression = k.z;
    in.options.compression_block = 256;
    const Plan p = make_plan(in);
    CHECK(std::string(name_of(p.variant)) == k.want && p.fallback.empty() && p.run,
          "%s asked as %s (determinism %s, %s): %s, want %s", name_of(k.c), name_of(k.a), name_of(k.d), name_of(k.z),
          name_of(p.variant), k.want);
  }
  // The device team runs the one-shot all-reduces that fit it, uncompressed.
  PlanInput device = input(one, 64 << 10, Collective::AllReduce, Algorithm::OneShot);
  device.device_memory = true;
  device.device_team_bytes = 64 << 10;
  CHECK(std::string(label(device)) == "oneshot-flags", "fits the team: %s", label(device));
  device.bytes = (64 << 10) + 4;
  CHECK(std::string(label(device)) == "oneshot", "larger than the team: %s", label(device));
  device.bytes = 4096;
  device.options.compression = Compression::Fp16;
  device.options.compression_block = 256;
  CHECK(std::string(label(device)) == "oneshot", "compressed: %s", label(device));
}

// Compressed calls are priced at their encoded bytes: fp8 on a slow link costs about a
// quarter of float32 where bytes dominate.
static void test_compression_is_priced() {
  const Topology two = uniform(2, 2);
  for (Algorithm a : {Algorithm::Ring, Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Hierarchical}) {
    PlanInput in = input(two, 64 << 20, Collective::AllReduce, a);
    const double plain = predicted_us(a, in);
    in.options.compression = Compression::Fp8E4M3;
    in.options.compression_block = 256;
    const double fp8 = predicted_us(a, in);
    CHECK(fp8 < 0.3 * plain && fp8 > 0.2 * plain, "%s: fp8 %.0f us vs float32 %.0f us", name_of(a), fp8, plain);
  }
  // The deterministic ring is priced as what it runs: a direct reduce-scatter then a ring.
  PlanInput in = input(two, 64 << 20, Collective::AllReduce, Algorithm::Ring);
  const double ring = predicted_us(Algorithm::Ring, in);
  in.options.determinism = Determinism::Ordered;
  const double direct_ring = predicted_us(Algorithm::Ring, in);
  CHECK(direct_ring != ring, "direct+ring priced as a ring: %.0f us", ring);
}

// Reduce-scatter and all-gather across nodes: the two-level variants where the link is
// slow, 1.5x less over it than a flat ring on 2 x 2 (bound: (n-1)/n against (N-1)/N), and
// the reduce-scatter's partial sums kept out of the deterministic modes.
static void test_two_level_reduce_scatter_and_all_gather() {
  const Topology one = uniform(1, 4), two = uniform(2, 2);
  for (Collective c : {Collective::ReduceScatter, Collective::AllGather}) {
    const PlanInput large = input(two, 64 << 20, c);
    CHECK(std::string(label(large)) == "hierarchical", "%s of 64 MiB on 2 x 2: %s", name_of(c), label(large));
    const double ratio = predicted_us(Algorithm::Ring, large) / predicted_us(Algorithm::Hierarchical, large);
    CHECK(ratio > 1.4 && ratio < 1.51, "%s: ring / hierarchical predicted %.2f", name_of(c), ratio);
    const Plan single = make_plan(input(one, 64 << 20, c, Algorithm::Hierarchical));
    CHECK(
        single.algorithm != Algorithm::Hierarchical && single.fallback.find("more than one node") != std::string::npos,
        "%s on one node: %s", name_of(c), single.fallback.c_str());
    PlanInput exact = input(two, 64 << 20, c, Algorithm::Hierarchical);
    exact.options.determinism = Determinism::Exact;
    const Plan p = make_plan(exact);
    if (c == Collective::AllGather)
      CHECK(p.algorithm == Algorithm::Hierarchical, "exact all-gather: %s", p.fallback.c_str());
    else
      CHECK(p.algorithm != Algorithm::Hierarchical && p.fallback.find("deterministic") != std::string::npos,
            "exact reduce-scatter: %s (%s)", name_of(p.algorithm), p.fallback.c_str());
  }
}

static void test_log_step_reduce_scatter_and_all_gather() {
  // The tree family serves both, in every mode: its reduce-scatter forwards contributions
  // where partial sums would change bits.
  const Topology one = uniform(1, 4);
  for (Collective c : {Collective::ReduceScatter, Collective::AllGather})
    for (Determinism d : {Determinism::Default, Determinism::Ordered, Determinism::Exact})
      for (Compression codec : {Compression::None, Compression::Fp8E4M3}) {
        PlanInput in = input(one, 4096, c, Algorithm::Tree);
        in.options.determinism = d;
        in.options.compression = codec;
        in.options.compression_block = 256;
        const Plan p = make_plan(in);
        const char* expected = c == Collective::ReduceScatter ? "recursive-halving" : "bruck";
        CHECK(std::string(name_of(p.variant)) == expected && p.fallback.empty(), "tree %s, %s, %s: %s (%s)", name_of(c),
              name_of(d), name_of(codec), name_of(p.variant), p.fallback.c_str());
      }
  // Across hosts, one rank each: log2 n latencies against the ring's n-1 while they
  // dominate, the ring once bytes do (its partial sums travel once; halving's plain
  // partials too, but forwarded contributions would cost log2 n halves of the buffer).
  const Topology hosts = uniform(64, 1);
  for (Collective c : {Collective::ReduceScatter, Collective::AllGather}) {
    // Over shared memory the direct pass, whose frames arrive at once, stays.
    CHECK(std::string(label(input(one, 4096, c))) == "direct", "%s of 4 KiB on one node: %s", name_of(c),
          label(input(one, 4096, c)));
    PlanInput tcp = input(one, 4096, c);
    tcp.network = true;
    CHECK(std::string(chosen(tcp)) == "tree", "%s of 4 KiB on one node over TCP: %s", name_of(c), chosen(tcp));
    CHECK(std::string(chosen(input(hosts, 4096, c))) == "tree", "%s of 4 KiB on 64 hosts: %s", name_of(c),
          chosen(input(hosts, 4096, c)));
    const double ratio =
        predicted_us(Algorithm::Ring, input(hosts, 4096, c)) / predicted_us(Algorithm::Tree, input(hosts, 4096, c));
    CHECK(ratio > 5, "%s of 4 KiB on 64 hosts: ring / tree predicted %.1f", name_of(c), ratio);
    PlanInput ordered = input(hosts, 64 << 20, c);
    ordered.options.determinism = Determinism::Ordered;
    CHECK(std::string(chosen(ordered)) != "tree", "ordered %s of 64 MiB on 64 hosts: %s", name_of(c), chosen(ordered));
  }
}

// Point-to-point: a recv names its sender or finds it as it runs (two rows of one label);
// on device memory the same functions run over the host channels, the device copying,
// labelled p2p-via-host, within a node or across nodes alike.
static void test_point_to_point() {
  const Topology one = uniform(1, 4), two = uniform(2, 2);
  for (const Topology* t : {&one, &two})
    for (bool device : {false, true}) {
      PlanInput send = input(*t, 64, Collective::Send), named = input(*t, 64, Collective::Recv);
      send.device_memory = named.device_memory = device;
      PlanInput any = named;
      any.from_any_source = true;
      CHECK(make_plan(send).run == p2p_send && make_plan(named).run == p2p_recv &&
                make_plan(any).run == p2p_recv_from_any,
            "p2p rows on %s memory, %d nodes", device ? "device" : "host", t->node_count());
      const std::string expected = device ? "p2p-via-host" : "p2p";
      for (const PlanInput* in : {&send, &named, &any})
        CHECK(label(*in) == expected, "%s%s on %s memory, %d nodes: %s", name_of(in->collective),
              in->from_any_source ? " from any source" : "", device ? "device" : "host", t->node_count(), label(*in));
    }
}

// The default mode prices a link between nodes at its class: the reference TCP link,
// slower by the whole power of ten nearest to the measurement, never faster. A 1 Gbit/s
// link is priced as one, whatever the noise of its measurement, and so the 64 MiB
// all-reduce of 2 x 2 ranks across it is hierarchical, as its measured costs say.
static void test_link_classes() {
  const LinkCost reference = reference_link_costs(1).inter;
  const auto priced = [&](double bytes_per_us) { return link_class({50, bytes_per_us}, reference); };
  for (double gbe1 : {90.0, 117.0, 134.0, 180.0, 290.0})  // 1 GbE measured, noisy; 2.5 GbE
    CHECK(priced(gbe1).bytes_per_us == reference.bytes_per_us / 10, "%g B/us: %g", gbe1, priced(gbe1).bytes_per_us);
  for (double fast : {450.0, 1100.0, 2900.0, 12000.0})  // 5, 10, 25, 100 GbE
    CHECK(priced(fast).bytes_per_us == reference.bytes_per_us, "%g B/us: %g", fast, priced(fast).bytes_per_us);
  CHECK(priced(11.0).bytes_per_us == reference.bytes_per_us / 100, "100 Mbit/s: %g", priced(11.0).bytes_per_us);
  CHECK(priced(117.0).latency_us == reference.latency_us, "the latency stays the reference's");

  const Topology two = uniform(2, 2);
  PlanInput in = input(two, 64 << 20);
  in.reference_costs = reference_link_costs(1);
  CHECK(std::string(chosen(in)) == "ring", "64 MiB at the reference link: %s", chosen(in));
  in.reference_costs.inter = link_class(in.costs.inter, in.reference_costs.inter);
  CHECK(std::string(chosen(in)) == "hierarchical", "64 MiB at 1 GbE's class: %s", chosen(in));
}

int main() {
  test_link_classes();
  test_point_to_point();
  test_log_step_reduce_scatter_and_all_gather();
  test_two_level_reduce_scatter_and_all_gather();
  test_labels_say_what_runs();
  test_compression_is_priced();
  test_requested_algorithm_is_honoured_where_it_serves();
  test_device_memory();
  test_deterministic_modes();
  test_fallback_says_why();
  test_auto_choices();
  test_costs_drive_the_choice();
  test_single_rank();
  if (failures) std::fprintf(stderr, "%d plan checks failed\n", failures);
  else std::printf("plan: all checks passed\n");
  return failures ? 1 : 0;
}
