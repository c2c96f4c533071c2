#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "runtime/communicator.h"

namespace pycomm {

// Link costs are measured on one pair per link class (the lowest-numbered pair within a
// node, and across nodes) and shared through the store, so that every rank selects
// algorithms from the same numbers. The reference costs come from rank 0's machine (its
// ranks per core), shared the same way, the link between nodes at its class (link_class).
// With PYCOMM_LINK_COSTS naming an existing file,
// rank 0 reads it instead ("intra <latency_us> <bytes_per_us>" and "inter ..." lines),
// and its costs are both the measured and the reference ones: pinned, so that every run
// prices alike; naming a missing file, rank 0 writes the measured costs there.
void Communicator::calibrate(Store& store, const std::string& prefix) {
  const std::string& file = config_.link_costs_file;
  if (rank_ == 0) {
    std::ifstream in(file);
    std::stringstream text;
    if (!file.empty() && in) text << in.rdbuf();
    store.set(prefix + "/linkcost/file", text.str());
    int local_ranks = 0;
    for (const PeerInfo& p : ranks_) local_ranks += p.shares_host_with(ranks_[0]);
    store.set(prefix + "/linkcost/ranks_per_core",
              std::to_string(static_cast<double>(local_ranks) / std::max(1, cores_available())));
  }
  const std::string cached = store.get(prefix + "/linkcost/file");
  reference_costs_ = reference_link_costs(std::stod(store.get(prefix + "/linkcost/ranks_per_core")));
  LinkCost* references[2] = {&reference_costs_.intra, &reference_costs_.inter};
  LinkCost* classes[2] = {&costs_.intra, &costs_.inter};
  const char* names[2] = {"intra", "inter"};
  for (int cls = 0; cls < 2; ++cls) {
    std::string value;
    std::istringstream lines(cached);
    for (std::string line; std::getline(lines, line);)
      if (line.rfind(std::string(names[cls]) + " ", 0) == 0) value = line.substr(std::strlen(names[cls]) + 1);
    const bool pinned = !value.empty();
    if (!pinned) {
      int a = -1, b = -1;
      for (int i = 0; i < size_ && a < 0; ++i)
        for (int j = i + 1; j < size_ && a < 0; ++j)
          if ((topology_.node_of[i] == topology_.node_of[j]) == (cls == 0)) {
            a = i;
            b = j;
          }
      if (a < 0) continue;  // no such link: the class does not matter
      const std::string key = prefix + "/linkcost/" + names[cls];
      Context cx = context();
      cx.stamp.collective = static_cast<uint8_t>(Collective::Barrier);
      cx.deadline = Deadline::after(timeout_);
      // The latency is a step of many ranks at once, as the algorithms take them (ranks
      // may outnumber the cores, which a lone pair would not see): within a node, of the
      // node's ranks; across nodes, of the whole group. The bandwidth is the lone pair's.
      const std::vector<int>& node = topology_.nodes[topology_.node_of[a]];
      double step_us = 0;
      if (cls == 0 && topology_.node_of[rank_] == topology_.node_of[a]) step_us = step_latency_us(cx.team(node));
      if (cls == 1) step_us = step_latency_us(cx);
      if (rank_ == a || rank_ == b) {
        LinkCost c = ping_pong(cx, rank_ == a ? b : a, rank_ == a);
        c.latency_us = step_us;
        if (rank_ == a) store.set(key, std::to_string(c.latency_us) + " " + std::to_string(c.bytes_per_us));
      }
      value = store.get(key);
    }
    std::istringstream fields(value);
    if (!(fields >> classes[cls]->latency_us >> classes[cls]->bytes_per_us) || classes[cls]->bytes_per_us <= 0)
      fail(ErrorKind::InvalidArgument, "pycomm: malformed link costs '" + value + "' (PYCOMM_LINK_COSTS=" + file + ")");
    if (pinned) *references[cls] = *classes[cls];
    else if (cls == 1) reference_costs_.inter = link_class(costs_.inter, reference_costs_.inter);
  }
  if (rank_ == 0 && !file.empty() && cached.empty()) {
    std::ofstream out(file);
    out << "intra " << costs_.intra.latency_us << " " << costs_.intra.bytes_per_us << "\n"
        << "inter " << costs_.inter.latency_us << " " << costs_.inter.bytes_per_us << "\n";
  }
}

}  // namespace pycomm
