// How the ranks of a group are grouped into nodes (hosts, or PYCOMM_RANKS_PER_NODE
// groups), which is what hierarchical algorithms and the plans need to know.
#pragma once

#include <vector>

namespace pycomm {

struct Topology {
  std::vector<std::vector<int>> nodes;  // group ranks of each node, ascending
  std::vector<int> node_of;             // node index of each rank

  // Ranks are numbered node by node, nodes have their order of first appearance.
  static Topology from_node_of(const std::vector<int>& node_of) {
    Topology t;
    t.node_of = node_of;
    for (int r = 0; r < static_cast<int>(node_of.size()); ++r) {
      if (node_of[r] >= static_cast<int>(t.nodes.size())) t.nodes.resize(node_of[r] + 1);
      t.nodes[node_of[r]].push_back(r);
    }
    return t;
  }
  int node_count() const { return static_cast<int>(nodes.size()); }
  int world() const { return static_cast<int>(node_of.size()); }
  // Every node has the same number of ranks (what hierarchical all-reduce requires).
  bool uniform() const {
    for (const auto& n : nodes)
      if (n.size() != nodes.front().size()) return false;
    return !nodes.empty();
  }
  int ranks_per_node() const { return uniform() ? static_cast<int>(nodes.front().size()) : 0; }
};

}  // namespace pycomm
