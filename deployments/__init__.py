"""Ray Serve deployments of moe-serve, as plain classes wired by one builder.

- `builder.py`: the only module that wires Serve (manifest -> application); `config_app.py`:
  the same application as a Serve config `import_path` builder (serve deploy / KubeRay).
- `frontend/`: the OpenAI ingress (HTTP, validation and rendering through vLLM's front end,
  streaming, admission) and its parts.
- `engine/`: the engine server (one vLLM engine per replica or rank) and its vLLM adapters.
- `expert_parallel/`: an engine group of N ranks serving as one replica.
- `routing/`: request routing and admission policies (pure) and their Serve adapter.
- At the top, what every part shares: the records crossing process boundaries (`records.py`),
  the engine client and server protocols (`engine_client.py`), the disaggregated client
  (`disagg_client.py`), bounded waits (`stream_deadlines.py`) and HTTP errors (`errors.py`).
"""
