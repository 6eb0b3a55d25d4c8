"""From a manifest to a running cluster, by layer, bottom to top. Three imports still go up a
layer: the manifest's validators ask `checkpoints` (builtin names) and `vllm_parsers` (parser
names), and `kuberay` asks `ray_node_env` for the variables every node starts with.

Configuration: `manifest` and its sections (`manifest_kv`, `manifest_routing`,
`manifest_timeouts`, `manifest_autoscaling`, `manifest_http`, `manifest_kubernetes`,
`manifest_rdma`), `manifest_loading` (YAML in, every problem named), `errors`, `settings`.

Planning (pure): `plan`, `plan_memory`, `fit_check`, with what they read of a model:
`model_facts`, `model_arch`, `vllm_parsers`; `checkpoints` builds the tiny local ones.

Rendering: `serve_config` (a Ray Serve config file), `kuberay` with `kuberay_shape`,
`kuberay_rdma`, `kuberay_extras` and `kuberay_validate` (a RayService and what goes beside it).

Operations and the CLI on top: `local_cluster`, `ray_node_env`, `process_tree`, `leftovers`
(with `leftover_processes`), `kv_pool_service` (the pool's master), `serve_control` (the
adapter to a running Ray and Serve), `app_registry`, `status_report`, and `cli` (`moe-serve`).
"""
