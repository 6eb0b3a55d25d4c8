"""The cluster-wide KV pool: one object per KV block, in Mooncake Store.

`store` (the interface, `PoolSettings`) and `mooncake_store` (its one adapter); `scheduler_tier`
and `worker_tier` (the connector's two sides of the pool); `objects`, `keys`, `checksum` (what an
object is and how it is named and verified); `disk_tier`, `session_pins` (the tiers under DRAM
and what stays in it); `store_queue`, `health`, `engine_wiring`, `records`, `mooncake_shared`.
"""
