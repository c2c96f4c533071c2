// Unit tests of the recorder alone (counters, flight recorder, JSON): no communication.
// Built and run by `make test` (target core-test).
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "check.h"
#include "runtime/recorder.h"

using namespace pycomm;

static OpStamp stamp(Collective c, uint64_t seq, Variant v) {
  OpStamp s;
  s.collective = static_cast<uint8_t>(c);
  s.seq = seq;
  s.count = 1000;
  s.dtype = static_cast<uint8_t>(DataType::Float32);
  s.variant = static_cast<uint8_t>(v);
  return s;
}

static bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

static void test_counters_and_last() {
  Recorder r(8, 3);
  const Recorder::Who who{"g", 1, 4};
  CHECK(has(r.stats_json(who),
            "\"collectives\": {}, \"verify\": {\"every\": 3, \"verified\": 0, \"mismatches\": 0}, "
            "\"last\": null"),
        "empty: %s", r.stats_json(who).c_str());
  r.verified(true);
  r.verified(false);
  CHECK(has(r.stats_json(who), "\"verify\": {\"every\": 3, \"verified\": 2, \"mismatches\": 1}"), "verified: %s",
        r.stats_json(who).c_str());
  r.end(r.begin(stamp(Collective::AllReduce, 1, Variant::Ring), 4000, -1, std::chrono::steady_clock::now()));
  r.end(r.begin(stamp(Collective::AllReduce, 2, Variant::Ring), 4000, -1, std::chrono::steady_clock::now()));
  r.end(r.begin(stamp(Collective::AllReduce, 3, Variant::Tree), 4000, -1, std::chrono::steady_clock::now()), "boom");
  r.end(r.begin(stamp(Collective::Broadcast, 4, Variant::Chain), 40, 0, std::chrono::steady_clock::now()));
  const std::string s = r.stats_json(who);
  CHECK(has(s, "\"group\": \"g\", \"rank\": 1, \"size\": 4"), "%s", s.c_str());
  CHECK(has(s, "\"allreduce\": {\"ring\": {\"calls\": 2, \"failures\": 0, \"bytes\": 8000, "), "%s", s.c_str());
  CHECK(has(s, "\"tree\": {\"calls\": 1, \"failures\": 1, \"bytes\": 4000, "), "%s", s.c_str());
  CHECK(has(s, "\"broadcast\": {\"chain\": {\"calls\": 1, "), "%s", s.c_str());
  CHECK(has(s, "\"last\": {\"id\": 4, \"collective\": \"broadcast\", \"seq\": 4, ") && has(s, "\"root\": 0") &&
            has(s, "\"device\": \"cuda:0\"") && has(s, "\"state\": \"completed\""),
        "%s", s.c_str());
}

static void test_flight_recorder_keeps_the_last_and_the_running() {
  Recorder r(3);
  for (uint64_t i = 1; i <= 5; ++i)
    r.end(r.begin(stamp(Collective::AllReduce, i, Variant::Ring), 4, -1, std::chrono::steady_clock::now()));
  const uint64_t send = r.begin(stamp(Collective::Send, 1, Variant::P2P), 4, -1,
                                std::chrono::steady_clock::now());   // p2p lanes may overlap
  const uint64_t recv = r.begin(stamp(Collective::Recv, 1, Variant::P2P), 4, -1, std::chrono::steady_clock::now());
  r.end(send);
  const std::string d = r.dump_json({"g", 0, 2}, "a \"quoted\"\nreason");
  CHECK(has(d, "\"format\": \"pycomm.flight_recorder/1\""), "%s", d.c_str());
  CHECK(has(d, "\"reason\": \"a \\\"quoted\\\"\\u000areason\""), "escaped: %s", d.c_str());
  CHECK(!has(d, "\"seq\": 4,") && has(d, "\"id\": 5, ") && has(d, "\"id\": 6, ") && has(d, "\"id\": 7, "),
        "the last 3: %s", d.c_str());
  CHECK(has(d,
            "\"collective\": \"send\", \"seq\": 1, \"dtype\": \"float32\", \"count\": 1000, \"bytes\": 4, \"tag\": 0, "
            "\"algorithm\": \"p2p\", \"compression\": \"none\", \"determinism\": \"0\", \"device\": \"cpu\", "
            "\"state\": \"completed\""),
        "%s", d.c_str());
  CHECK(has(d, "\"collective\": \"recv\"") && has(d, "\"state\": \"running\""), "%s", d.c_str());
  r.end(recv, "peer gone");
  CHECK(has(r.dump_json({"g", 0, 2}, ""), "\"state\": \"failed\", \"start_unix_us\""), "failed recv");
  CHECK(has(r.dump_json({"g", 0, 2}, ""), "\"error\": \"peer gone\"}"), "error text");

  Recorder none(0);
  none.end(none.begin(stamp(Collective::Barrier, 1, Variant::Dissemination), 0, -1, std::chrono::steady_clock::now()));
  CHECK(has(none.dump_json({"g", 0, 1}, ""), "\"entries\": []"), "capacity 0 keeps no entry");
  CHECK(has(none.stats_json({"g", 0, 1}), "\"barrier\": {\"dissemination\": {\"calls\": 1"), "but counts");
}

static void test_atomic_file() {
  const std::string path = "/tmp/pycomm-test-recorder-" + std::to_string(getpid()) + ".json";
  CHECK(write_file_atomically(path, "{}\n"), "write %s", path.c_str());
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  CHECK(text.str() == "{}\n", "read back: %s", text.str().c_str());
  std::remove(path.c_str());
  CHECK(!write_file_atomically("/nonexistent-dir/x.json", "{}"), "an unwritable path reports false");
}

int main() {
  test_counters_and_last();
  test_flight_recorder_keeps_the_last_and_the_running();
  test_atomic_file();
  if (failures) std::fprintf(stderr, "%d recorder checks failed\n", failures);
  else std::printf("recorder: all checks passed\n");
  return failures ? 1 : 0;
}
