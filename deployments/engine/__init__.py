"""The engine server: `LLMServer` runs one vLLM engine (a pool replica, or one rank of an
expert-parallel group) and speaks tokens in, tokens out; `vllm_engine.py` builds the engine from
the manifest. The `vllm_*` modules adapt vLLM itself (CPU expert-parallel shim, the MLA rotary
fix and the orphan guard as vLLM plugins, scheduler snapshots for metrics);
`expert_observation.py` is the worker extension every expert-parallel rank loads to report its
experts and their load."""
