"""Moving KV cache from prefill to decode: our vLLM KV connector, transports, leases."""
