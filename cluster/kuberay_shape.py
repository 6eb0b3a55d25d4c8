"""How many pods of which size each pool needs in a RayService: pure arithmetic, no I/O.

Rule: one pod is one Ray node. A plain pool runs one replica per pod (its placement.num_gpus,
e.g. 8 GPUs for a tensor-parallel-8 replica, must fit one node). An expert-parallel pool runs
`expert_parallel.size` ranks per replica; with a spreading placement strategy (SPREAD,
STRICT_SPREAD) every rank is its own pod, with a packing one (PACK, STRICT_PACK) a pod holds as
many ranks as one node's GPUs (kubernetes.gpus_per_node), so a group's ranks share NVLink and
the group needs ceil(size / ranks_per_pod) pods. Pod counts are replica counts times pods per
replica, for the starting size and both autoscaling bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.errors import ManifestError, ManifestIssue
from cluster.manifest import Manifest, PoolSpec


@dataclass(frozen=True)
class PodShape:
    """The worker group of one pool: its pods' size and how many of them."""

    pool: str
    ranks_per_pod: int  # engine ranks (or replicas, for plain pools) one pod hosts
    pods_per_replica: int  # pods one replica (an expert-parallel group) spans
    replicas: int  # pods at the pool's starting size
    min_replicas: int  # pods at the autoscaling lower bound (= replicas without autoscaling)
    max_replicas: int  # pods at the upper bound
    num_cpus: float  # per pod
    num_gpus: int  # per pod
    memory_gib: float  # per pod


def pod_shapes(manifest: Manifest) -> list[PodShape]:
    """One PodShape per pool, in the manifest's order; ManifestError when a pool cannot be laid
    out as pods (a replica larger than a node, fractional GPUs per pod)."""
    shapes, issues = [], []
    for index, pool in enumerate(manifest.pools):
        shape = _shape(manifest, index, pool, issues)
        if shape is not None:
            shapes.append(shape)
    if issues:
        raise ManifestError(f"{manifest.name} (kubernetes layout)", issues)
    return shapes


def _shape(manifest: Manifest, index: int, pool: PoolSpec, issues: list[ManifestIssue]) -> PodShape | None:
    per_node = manifest.kubernetes.gpus_per_node
    gpus_per_rank = pool.placement.num_gpus
    ep = pool.expert_parallel
    if gpus_per_rank > per_node:
        issues.append(ManifestIssue(
            f"pools[{index}].placement.num_gpus", gpus_per_rank,
            f"more GPUs than one node has (kubernetes.gpus_per_node={per_node}); a replica must fit one pod",
            "lower num_gpus (and tensor_parallel_size), or raise kubernetes.gpus_per_node"))
        return None
    ranks_per_pod = 1
    if ep is not None and ep.placement_strategy in ("PACK", "STRICT_PACK"):
        ranks_per_pod = ep.size if gpus_per_rank == 0 else min(ep.size, int(per_node // gpus_per_rank))
        if ep.placement_strategy == "STRICT_PACK" and ranks_per_pod < ep.size:
            issues.append(ManifestIssue(
                f"pools[{index}].expert_parallel.placement_strategy", ep.placement_strategy,
                f"STRICT_PACK puts all {ep.size} ranks ({ep.size * gpus_per_rank:g} GPUs) on one node, "
                f"and kubernetes.gpus_per_node is {per_node}",
                "use PACK (ranks fill whole nodes) or a smaller expert_parallel.size"))
            return None
    gpus = ranks_per_pod * gpus_per_rank
    if gpus != int(gpus):
        issues.append(ManifestIssue(
            f"pools[{index}].placement.num_gpus", gpus_per_rank,
            f"a pod of {ranks_per_pod} rank(s) would hold {gpus:g} GPUs; pods take whole GPUs",
            "give each replica (rank) a whole number of GPUs"))
        return None
    ranks = pool.ranks_per_replica
    pods_per_replica = math.ceil(ranks / ranks_per_pod)
    bounds = pool.autoscaling
    low = bounds.min_replicas if bounds else pool.replicas
    high = bounds.max_replicas if bounds else pool.replicas
    cpus = max(ranks_per_pod * pool.placement.num_cpus, 1.0)  # a pod needs some CPU to run Ray itself
    return PodShape(pool.name, ranks_per_pod, pods_per_replica, pool.replicas * pods_per_replica,
                    low * pods_per_replica, high * pods_per_replica, cpus, int(gpus),
                    cpus * manifest.kubernetes.memory_gib_per_cpu)
