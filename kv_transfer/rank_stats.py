"""One engine's KV counters from its tensor-parallel workers' (pure: dicts in, dict out).

Each TP worker runs its own connector and answers stats on its own port. They see the same
requests, leases and blocks (every rank holds its shard of every block), but move only their
shard's bytes, and each serves its own connections. So, per counter:
- bytes and the transfer server's own counters (`server_*`): summed (the engine moved them all);
- `pool_up`: the lowest (the pool is up for the engine only if every rank reaches it);
- everything else (requests, leases, blocks, failures, seconds): the highest, the engine's view
  of a step that every rank takes: a pull that failed on one rank failed the request's load,
  and a load is as slow as its slowest rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def merge_rank_stats(ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if not ranks:
        return {}
    if len(ranks) == 1:
        return dict(ranks[0])
    merged: dict[str, Any] = {}
    for name in dict.fromkeys(key for rank in ranks for key in rank):
        values = [rank[name] for rank in ranks if isinstance(rank.get(name), (int, float))]
        if not values:
            merged[name] = ranks[0].get(name)
        elif "bytes" in name or name.startswith("server_"):
            merged[name] = sum(values)
        elif name == "pool_up":
            merged[name] = min(values)
        else:
            merged[name] = max(values)
    return merged
