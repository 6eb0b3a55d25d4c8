"""The engine server: `LLMServer` runs one vLLM engine (a pool replica, or one rank of an
expert-parallel group) and speaks tokens in, tokens out; `vllm_engine.py` builds the engine from
the manifest. The `vllm_*` modules adapt vLLM itself (CPU expert-parallel shim, the MLA rotary
fix and the orphan guard as vLLM plugins, scheduler snapshots for metrics)."""
