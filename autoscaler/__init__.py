"""SLO-driven, coordinated autoscaling of prefill and decode pools (the pure parts).

Policy (no I/O; time comes in as `now_s`, metrics as plain data):
- `observations`: what a policy sees per pool, its limits and config, what it decides.
- `controller`: `CoordinatedController`, a thin loop over the parts below.
  - `signals`: one pool's load as normalised signals; `sizing`: replicas needed per signal kind;
  - `arrival_trend`: rising arrivals extrapolated over the replica start time;
  - `pool_history`: cooldowns, calm and idle stretches; `pool_plan`: one pool's wish and range;
  - `coordination`: wake partners, prefill:decode ratio, shared budget.
- `baselines`: `FixedSplit` and `QueueLengthPerPool` (Ray Serve's default rule) to compare with.
- `replay`: recorded observations through a policy, as an event log (regression tests).

Evaluation:
- `simulator` (with `sim_pools`, `sim_decode`, `sim_metrics`), `traces`, `service_model`:
  a discrete-event cluster simulator, seeded traces and two calibrations.

The policy and the simulator import no Ray, vLLM, torch, Prometheus or httpx. The adapters do,
each to one system: `prometheus_source` (observations from Prometheus, over httpx),
`serve_policy` and `serve_loop` (Ray Serve's custom autoscaling policy, running the controller
in Serve's controller process and exporting its decisions), and `settings` (what the builder
hands Serve as the policy's kwargs).
"""
