"""Moving KV cache between engines: our vLLM KV connector, its transports and leases, and the
cluster-wide KV pool.

- `connector` (vLLM's connector API) over `connector_scheduler` (engine-core side: what to pull,
  lend and store) and `connector_worker` (worker side: the bytes); `params`: the typed transfer
  parameters; `grants`, `leases`, `releaser`: who may read which blocks, and until when.
- `kv_pages`, `host_staging`: engine KV pages as torch tensors on their device, and host staging.
- `transport/`: TCP and Mooncake's transfer engine, moving the bytes of a pull.
- `pool/`: the KV pool on Mooncake Store (prefix blocks stored by any engine, loaded by any
  other), its disk tier and session pins.
"""
