"""What `moe-serve status` calls degraded, from plain views of Ray's nodes and Serve's status.

Degraded means serving below what was deployed, or about to: a node that left the cluster
(with the labels that said which pool's replicas it carried), and every deployment Serve does
not report HEALTHY (or scaling), with its running replica count and Serve's own explanation
(e.g. the resources a replacement replica waits for). A deployment that is still coming up
after a deploy is listed too: until it runs, the application serves less than its manifest says.

Pure: no Ray import; cluster/serve_control.py builds the views.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Serve's deployment statuses that mean "serving as deployed" (scaling is the autoscaler at work).
_SERVING = {"HEALTHY", "UPSCALING", "DOWNSCALING"}
_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class NodeView:
    node_id: str
    address: str
    alive: bool
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DeploymentView:
    name: str
    status: str
    replica_states: Mapping[str, int] = field(default_factory=dict)
    message: str = ""

    @property
    def running(self) -> int:
        return int(self.replica_states.get("RUNNING", 0))


@dataclass(frozen=True)
class AppView:
    name: str
    status: str
    deployments: Sequence[DeploymentView] = ()


def degraded_lines(apps: Sequence[AppView], nodes: Sequence[NodeView]) -> list[str]:
    """One line per problem, most fundamental first (lost nodes, then deployments); empty when
    everything runs as deployed."""
    lines = []
    for node in nodes:
        if not node.alive:
            labels = ", ".join(f"{k}={v}" for k, v in sorted(node.labels.items())) or "no labels"
            lines.append(f"node {node.address} {node.node_id[:12]} left the cluster ({labels}): replicas that "
                         "need its labels are replaced only where another node has them and free resources")
    for app in apps:
        for dep in app.deployments:
            if dep.status in _SERVING:
                continue
            others = ", ".join(f"{state.lower()} {count}" for state, count in sorted(dep.replica_states.items())
                               if state != "RUNNING" and count)
            line = f"{app.name}/{dep.name}: {dep.status}, {dep.running} running" + (f", {others}" if others else "")
            if dep.message:
                line += f": {' '.join(dep.message.split())[:_MESSAGE_CHARS]}"
            lines.append(line)
    return lines
