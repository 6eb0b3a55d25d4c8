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

Nothing here imports Ray, vLLM, torch, Prometheus or httpx.
"""
