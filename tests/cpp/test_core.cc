// Torch-free tests of the core: the per-element numerics, the CPU reduce kernel, and
// every collective of the Communicator, with threads of one process playing the ranks
// over the real shared-memory and TCP transports. Exit status 0 when every check passed.
// Built and run by `make test` (target core-test).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "core/numerics.h"
#include "core/perturbation.h"
#include "device/device_ops.h"
#include "runtime/communicator.h"
#include "world.h"

using namespace pycomm;

static void test_half_and_bf16() {
  // Every binary16 value survives half -> float -> half; NaN stays NaN.
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = float_from_half_bits(h);
    const uint32_t back = half_bits_from_float(f);
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
    CHECK(nan ? (back & 0x7c00) == 0x7c00 && (back & 0x3ff) : back == h, "half 0x%04x -> 0x%04x", h, back);
  }
  struct {
    float in;
    uint16_t half;
  } cases[] = {
      {1.0f, 0x3c00},
      {1.0f + 1.0f / 2048, 0x3c00} /* tie -> even */,
      {1.0f + 3.0f / 2048, 0x3c02},
      {65504.0f, 0x7bff},
      {65519.0f, 0x7bff},
      {65520.0f, 0x7c00} /* rounds to Inf */,
      {-1e9f, 0xfc00},
      {5.9604645e-8f, 0x0001} /* smallest subnormal */,
      {2.9e-8f, 0x0000},
      {-0.0f, 0x8000},
  };
  for (auto c : cases)
    CHECK(half_bits_from_float(c.in) == c.half, "half(%g) = 0x%04x", c.in, half_bits_from_float(c.in));
  CHECK(bf16_bits_from_float(1.0f + 1.0f / 256) == 0x3f80, "bf16 tie to even");
  CHECK(bf16_bits_from_float(1.0f + 3.0f / 256) == 0x3f82, "bf16 round up");
  CHECK(bf16_bits_from_float(std::nanf("")) == 0x7fc0, "bf16 NaN");
  CHECK(float_from_bf16_bits(0x3f80) == 1.0f, "bf16 -> float");
}

static void test_operators() {
  CHECK(wrap_add<int8_t>(127, 1) == -128, "int8 sum wraps");
  CHECK(wrap_mul<int64_t>(INT64_MAX, 2) == -2, "int64 product wraps");
  CHECK(wrap_mul<uint8_t>(200, 2) == 144, "uint8 product wraps");
  CHECK(std::isnan(reduce_op<ReduceKind::Max>(1.0f, NAN)), "max propagates NaN");
  CHECK(std::isnan(reduce_op<ReduceKind::Min>(NAN, 1.0f)), "min propagates NaN");
  CHECK((finalize<ReduceKind::Avg, int32_t>(-7, 2) == -3), "integer avg truncates toward zero");
}

static void test_kernel() {
  const ReduceSpec spec{DataType::Float16, Reduction{ReduceKind::Avg}, 3};
  std::vector<Half> local(5), out(5);
  std::vector<float> partial(5);
  for (int i = 0; i < 5; ++i) {
    local[i] = Numeric<Half>::store(static_cast<float>(i));
    partial[i] = 2.0f * i;
  }
  cpu_ops().reduce(spec, Stage::Final, out.data(), local.data(), partial.data(), 5);
  for (int i = 0; i < 5; ++i) CHECK(float_from_half_bits(out[i].bits) == static_cast<float>(i), "avg of fp16");
}

// DeviceOps::hash: host memory hashed in place gives what the default gives, which copies
// it through the host a block at a time; every single flipped bit changes it, at any
// position (the last partial step and the second block included), and so does the length.
static void test_hash() {
  struct CopyingOps final : DeviceOps {
    std::shared_ptr<char> allocate(size_t bytes) const override { return cpu_ops().allocate(bytes); }
    void copy(void* dst, const void* src, size_t bytes) const override { std::memcpy(dst, src, bytes); }
    void reduce_terms(const ReduceSpec&, Stage, void*, const Term*, int, size_t) const override {}
  } copying;
  const size_t mib = size_t{1} << 20;
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{8}, size_t{255}, size_t{256}, size_t{4099}, mib, mib + 8, 3 * mib + 5}) {
    std::vector<unsigned char> b(n);
    for (size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(i * 131 + (i >> 8) * 7);
    const uint64_t h = cpu_ops().hash(b.data(), n);
    CHECK(h == copying.hash(b.data(), n), "hash of %zu bytes in place differs from the one through the host", n);
    std::vector<size_t> positions = {0, n / 2, n - 1};
    if (n <= 512) {
      positions.clear();
      for (size_t i = 0; i < n; ++i) positions.push_back(i);
    }
    for (size_t i : positions) {
      if (i >= n) continue;
      for (int bit = 0; bit < 8; ++bit) {
        b[i] ^= static_cast<unsigned char>(1 << bit);
        CHECK(cpu_ops().hash(b.data(), n) != h, "flipping bit %d of byte %zu of %zu leaves the hash", bit, i, n);
        b[i] ^= static_cast<unsigned char>(1 << bit);
      }
    }
  }
  const std::vector<unsigned char> zeros(300, 0);
  CHECK(cpu_ops().hash(zeros.data(), 299) != cpu_ops().hash(zeros.data(), 300), "the length does not enter the hash");
}

static void with_world(int n, TransportChoice transport, const std::function<void(int, Communicator&)>& body) {
  with_world(n, [&](Config& cfg) { cfg.transport = transport; }, body);
}

static float value(int rank, size_t i) { return static_cast<float>((i * 7 + rank * 3) % 11); }

static void test_collectives(int n, TransportChoice transport) {
  const size_t count = 3001;  // odd, not divisible by 2..4, several chunks of 4 KiB
  with_world(n, transport, [&](int r, Communicator& comm) {
    auto run = [&](Request rq) {
      comm.validate(rq);
      comm.execute(rq);
    };
    std::vector<float> mine(count * n), out(count * n);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = value(r, i);
    auto sum_at = [&](size_t i) {
      float s = 0;
      for (int p = 0; p < n; ++p) s += value(p, i);
      return s;
    };

    Request ar;  // in-place all-reduce
    ar.collective = Collective::AllReduce;
    std::vector<float> buf(mine.begin(), mine.begin() + count);
    ar.input = ar.output = buf.data();
    ar.count = count;
    run(ar);
    for (size_t i = 0; i < count; ++i) CHECK(buf[i] == sum_at(i), "allreduce n=%d [%zu]", n, i);

    Request rs;
    rs.collective = Collective::ReduceScatter;
    rs.input = mine.data();
    rs.output = out.data();
    rs.count = count;
    run(rs);
    for (size_t i = 0; i < count; ++i) CHECK(out[i] == sum_at(r * count + i), "reduce_scatter n=%d", n);

    Request ag;
    ag.collective = Collective::AllGather;
    ag.input = mine.data();
    ag.output = out.data();
    ag.count = count;
    run(ag);
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < count; ++i) CHECK(out[p * count + i] == value(p, i), "allgather n=%d", n);

    for (int root = 0; root < n; ++root) {
      Request b;
      b.collective = Collective::Broadcast;
      b.root = root;
      std::vector<float> bb(mine.begin(), mine.begin() + count);
      b.input = b.output = bb.data();
      b.count = count;
      run(b);
      for (size_t i = 0; i < count; ++i) CHECK(bb[i] == value(root, i), "broadcast root %d", root);

      Request red;
      red.collective = Collective::Reduce;
      red.root = root;
      std::vector<float> rb(mine.begin(), mine.begin() + count);
      red.input = red.output = rb.data();
      red.count = count;
      run(red);
      for (size_t i = 0; i < count; ++i)
        CHECK(rb[i] == (r == root ? sum_at(i) : value(r, i)), "reduce root %d (non-roots untouched)", root);
    }

    Request a2a;  // rank r sends p+1 elements to every rank p
    a2a.collective = Collective::AllToAll;
    for (int p = 0; p < n; ++p) {
      a2a.send_counts.push_back(p + 1);
      a2a.recv_counts.push_back(r + 1);
    }
    std::vector<float> a2a_in, a2a_out(n * (r + 1));
    for (int p = 0; p < n; ++p)
      for (int i = 0; i <= p; ++i) a2a_in.push_back(100.0f * r + p);
    a2a.input = a2a_in.data();
    a2a.output = a2a_out.data();
    run(a2a);
    for (int p = 0; p < n; ++p)
      for (int i = 0; i <= r; ++i) CHECK(a2a_out[p * (r + 1) + i] == 100.0f * p + r, "alltoall");

    if (n > 1) {  // ring of sends, even ranks first so that nothing waits in a cycle
      Request s, v;
      s.collective = Collective::Send;
      s.root = (r + 1) % n;
      s.input = mine.data();
      s.count = count;
      v.collective = Collective::Recv;
      v.root = (r + n - 1) % n;
      v.output = out.data();
      v.count = count;
      if (r % 2 == 0) {
        run(s);
        run(v);
      } else {
        run(v);
        run(s);
      }
      for (size_t i = 0; i < count; ++i) CHECK(out[i] == value((r + n - 1) % n, i), "send/recv");

      // Rank 0 receives every other rank's message (several frames) from any source.
      if (r == 0) {
        std::vector<int> seen;
        for (int k = 1; k < n; ++k) {
          int source = -1;
          Request any = v;
          any.root = kAnySource;
          any.tag = 9;
          any.source = &source;
          run(any);
          CHECK(source > 0 && source < n, "recv from any source: sender %d", source);
          for (size_t i = 0; i < count; ++i) CHECK(out[i] == value(source, i), "recv from any source [%zu]", i);
          seen.push_back(source);
        }
        std::sort(seen.begin(), seen.end());
        for (int k = 1; k < n; ++k) CHECK(seen[k - 1] == k, "recv from any source: every sender once");
      } else {
        s.root = 0;
        s.tag = 9;
        run(s);
      }
    }
    Request bar;
    bar.collective = Collective::Barrier;
    run(bar);
  });
}

static void test_mismatch_is_reported() {
  with_world(2, TransportChoice::Shm, [&](int r, Communicator& comm) {
    std::vector<float> buf(10 + r);
    Request rq;
    rq.collective = Collective::AllReduce;
    rq.input = rq.output = buf.data();
    rq.count = buf.size();
    comm.validate(rq);
    bool raised = false;
    try {
      comm.execute(rq);
    } catch (const Error& e) {
      raised = e.kind() == ErrorKind::Mismatch || e.kind() == ErrorKind::PeerFailure;
    }
    CHECK(raised, "rank %d: count mismatch not reported", r);
  });
}

// PYCOMM_VERIFY: a bit flipped in one rank's all-reduce result (PYCOMM_FAULT's flip) is
// found by every rank at that call, which names the rank and the call; the group stays
// failed. The exchange of hashes keeps the sequence numbers: the flip targets #2.
static void test_verification(TransportChoice transport) {
  const auto configure = [&](Config& c) {
    c.transport = transport;
    c.verify_every = 1;
    c.fault = "2:allreduce:2:after:flip";
  };
  with_world(4, configure, [&](int r, Communicator& comm) {
    std::vector<float> buf(1000, 1.0f);
    Request rq;
    rq.input = rq.output = buf.data();
    rq.count = buf.size();
    comm.validate(rq);
    comm.execute(rq);
    const auto failure = [&]() -> std::optional<Error> {
      try {
        comm.execute(rq);
      } catch (const Error& e) {
        return e;
      }
      return std::nullopt;
    };
    const std::optional<Error> flipped = failure();
    CHECK(flipped && flipped->kind() == ErrorKind::Corruption &&
              std::string(flipped->what()).find("allreduce #2 (") != std::string::npos &&
              std::string(flipped->what()).find("the result of rank 2 differs from the majority's (ranks 0,1,3)") !=
                  std::string::npos,
          "rank %d: %s", r, flipped ? flipped->what() : "no error");
    const std::string stats = comm.stats_json();
    CHECK(stats.find("\"verify\": {\"every\": 1, \"verified\": 2, \"mismatches\": 1}") != std::string::npos,
          "rank %d: %s", r, stats.c_str());
    const std::optional<Error> later = failure();
    CHECK(later && later->kind() == ErrorKind::PeerFailure &&
              std::string(later->what()).find("failed earlier") != std::string::npos,
          "rank %d: after the corruption: %s", r, later ? later->what() : "no error");
  });
}

// Exact mode: the result depends on the multiset of terms only (not their order, not
// extra zeros); non-finite terms give positive quiet NaN or the infinity, per element.
static void test_exact_sums() {
  const float inf = INFINITY, nan = NAN;
  // Per element, terms that a float fold gets wrong in some order.
  const std::vector<std::vector<float>> terms = {
      {1e30f, 1.0f, -1e30f, 3.0f, 0.5f, -0.25f},    // 1 and 3 lie 2^97 below the grid: 0
      {1.0f, 1e-8f, 1e-8f, 1e-8f, 1e-8f, -1.0f},  // within 2^36 of the largest: kept
      {3.0f, inf, -2.0f, 1.0f, 0.0f, 0.0f},       // +Inf
      {inf, -inf, 1.0f, 0.0f, 0.0f, 0.0f},        // NaN
      {nan, 1.0f, -inf, 0.0f, 0.0f, 0.0f},        // NaN
      {1e-45f, 1e-45f, -1e-45f, 1e-45f, 0.0f, 0.0f},  // subnormals (2^-149 each) add exactly
  };
  const float tiny = std::ldexp(1.0f, -149);  // the smallest subnormal
  const float expected[] = {0.0f, 4e-8f, inf, nan, nan, 2 * tiny};
  // The stated bound, k * 2^(E - 37) with E = 1 for element 1; the others are exact.
  const float tolerance[] = {0.0f, 6 * std::ldexp(1.0f, -36), 0.0f, 0.0f, 0.0f, 0.0f};
  const size_t n = terms.size();
  auto sum = [&](const std::vector<int>& order, int zeros) {
    std::vector<std::vector<float>> rows(order.size() + zeros, std::vector<float>(n, 0.0f));
    for (size_t j = 0; j < order.size(); ++j)
      for (size_t i = 0; i < n; ++i) rows[j][i] = terms[i][order[j]];
    std::vector<Term> t;
    for (auto& r : rows) t.push_back({r.data(), Form::Input});
    std::vector<float> out(n);
    const ReduceSpec spec{DataType::Float32, Reduction{}, static_cast<int>(t.size()), Compression::None, 0, true};
    cpu_ops().reduce_terms(spec, Stage::Final, out.data(), t.data(), static_cast<int>(t.size()), n);
    return out;
  };
  const std::vector<float> reference = sum({0, 1, 2, 3, 4, 5}, 0);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t got = bit_cast_<uint32_t>(reference[i]);
    const bool ok = std::isnan(expected[i])   ? got == 0x7fc00000u
                    : std::isinf(expected[i]) ? reference[i] == expected[i]
                                              : std::fabs(reference[i] - expected[i]) <= tolerance[i];
    CHECK(ok, "exact sum of element %zu: %g (0x%08x), expected %g", i, reference[i], got, expected[i]);
  }
  for (auto order : {std::vector<int>{5, 4, 3, 2, 1, 0}, std::vector<int>{2, 0, 5, 1, 3, 4}})
    for (int zeros : {0, 3})
      CHECK(std::memcmp(sum(order, zeros).data(), reference.data(), n * sizeof(float)) == 0,
            "exact sum changes with the order or %d zero terms", zeros);
}

// Creating a group costs each rank the same few store requests whatever the world size:
// the all-gathers publish, wait for every key at once and read them all in one request,
// and the TCP transport reads every lower peer's address the same way.
static void test_creation_store_requests() {
  double per_rank[3];
  const int sizes[3] = {4, 8, 16};
  for (int i = 0; i < 3; ++i) {
    pycomm_test::MemoryStore store;
    with_world(store, sizes[i], [](Config& c) { c.transport = TransportChoice::Tcp; }, [](int, Communicator&) {});
    per_rank[i] = static_cast<double>(store.requests()) / sizes[i];
  }
  std::printf("store requests per rank to create a group of 4, 8, 16 ranks: %.2f %.2f %.2f\n", per_rank[0], per_rank[1],
              per_rank[2]);
  CHECK(per_rank[2] <= per_rank[0] + 0.5 && per_rank[2] <= 16, "store requests per rank grow with the world size");
}

static void test_perturbation_spec() {
  Perturbation::Spec spec;
  CHECK(!Perturbation::parse("", 0, spec), "empty spec perturbs");
  CHECK(Perturbation::parse("7:40", 3, spec) && spec.seed == 7 && spec.max_us == 40 && spec.step < 0, "7:40");
  CHECK(!Perturbation::parse("7:40:2", 3, spec), "a spec for rank 2 perturbs rank 3");
  CHECK(Perturbation::parse("0:5000:3:1", 3, spec) && spec.max_us == 5000 && spec.step == 1, "0:5000:3:1");
  for (const char* bad : {"7", "x:1", "7:", "7:-1", "7:2000000", "7:40:", "7:40:1:", "7:40:1:2:3", "7:40:a"}) {
    bool raised = false;
    try {
      Perturbation::parse(bad, 0, spec);
    } catch (const Error& e) {
      raised = e.kind() == ErrorKind::InvalidArgument;
    }
    CHECK(raised, "PYCOMM_TEST_PERTURB='%s' accepted", bad);
  }
}

int main() {
  test_half_and_bf16();
  test_operators();
  test_kernel();
  test_exact_sums();
  test_hash();
  test_perturbation_spec();
  for (auto t : {TransportChoice::Shm, TransportChoice::Tcp})
    for (int n = 1; n <= 4; ++n) test_collectives(n, t);
  test_mismatch_is_reported();
  for (auto t : {TransportChoice::Shm, TransportChoice::Tcp}) test_verification(t);
  test_creation_store_requests();
  std::printf("test_core: %s (%d failures)\n", failures ? "FAILED" : "ok", failures);
  return failures ? 1 : 0;
}
