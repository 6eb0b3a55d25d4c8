"""`moe-serve status`: what it calls degraded (cluster/status_report.py), on hand-made views."""

from __future__ import annotations

from cluster.status_report import AppView, DeploymentView, NodeView, degraded_lines

HEALTHY_APP = AppView("moe-local", "RUNNING", [
    DeploymentView("openai-ingress", "HEALTHY", {"RUNNING": 1}),
    DeploymentView("prefill", "HEALTHY", {}),  # scaled to zero by the autoscaler: not degraded
    DeploymentView("decode", "UPSCALING", {"RUNNING": 1, "STARTING": 1}),
])
NODES = [NodeView("a" * 20, "10.0.0.1", True, {"moe-role": "head"}),
         NodeView("b" * 20, "10.0.0.2", True, {"moe-role": "decode"})]


def test_everything_running_as_deployed_is_not_degraded():
    assert degraded_lines([HEALTHY_APP], NODES) == []
    assert degraded_lines([], []) == []


def test_a_lost_node_and_the_pool_it_carried_are_named_with_serves_reason():
    nodes = [NODES[0], NodeView("c" * 20, "10.0.0.3", False, {"moe-role": "decode"})]
    app = AppView("moe-local", "DEPLOYING", [
        DeploymentView("openai-ingress", "HEALTHY", {"RUNNING": 1}),
        DeploymentView("decode", "UNHEALTHY", {"PENDING_ALLOCATION": 1},
                       "Deployment 'decode' has 1 replicas that have taken more than 30s to be scheduled.\n"
                       "Resources required: {'CPU': 1}"),
    ])
    lines = degraded_lines([app], nodes)
    assert lines == [
        "node 10.0.0.3 cccccccccccc left the cluster (moe-role=decode): replicas that need its labels are "
        "replaced only where another node has them and free resources",
        "moe-local/decode: UNHEALTHY, 0 running, pending_allocation 1: Deployment 'decode' has 1 replicas that "
        "have taken more than 30s to be scheduled. Resources required: {'CPU': 1}",
    ]


def test_long_messages_are_cut_and_unlabelled_nodes_say_so():
    app = AppView("a", "DEPLOY_FAILED", [DeploymentView("decode", "DEPLOY_FAILED", {}, "x" * 1000)])
    lines = degraded_lines([app], [NodeView("d" * 20, "10.0.0.4", False)])
    assert "(no labels)" in lines[0]
    assert lines[1] == "a/decode: DEPLOY_FAILED, 0 running: " + "x" * 300
