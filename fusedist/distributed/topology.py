"""Where every rank runs: world size, nodes, ranks per node, this rank's node.

Node identity comes from the launcher (launch_env.py: FUSEDIST_NODE_ID, SLURM_NODEID or the
hostname), gathered from all ranks once at init, so one host can act as several nodes.
Nodes are numbered in order of their lowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    node_ids: tuple[str, ...]  # node identity of every rank, indexed by rank

    @property
    def nodes(self) -> tuple[str, ...]:
        seen: list[str] = []
        for n in self.node_ids:
            if n not in seen:
                seen.append(n)
        return tuple(seen)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def node_of(self, rank: int) -> int:
        return self.nodes.index(self.node_ids[rank])

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def ranks_on_node(self, node: int) -> tuple[int, ...]:
        name = self.nodes[node]
        return tuple(r for r, n in enumerate(self.node_ids) if n == name)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.ranks_on_node(self.node)

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node when every node has the same number, else the smallest count."""
        return min(len(self.ranks_on_node(n)) for n in range(self.num_nodes))

    @property
    def uniform(self) -> bool:
        return len({len(self.ranks_on_node(n)) for n in range(self.num_nodes)}) == 1

    def same_node(self, ranks) -> bool:
        return len({self.node_ids[r] for r in ranks}) == 1
