"""The ledger core: vLLM 0.33's KV-cache ledger as a library (the bottom layer).

Block ids and reference counts (`block`, `block_pool`), prefix-cache hashes (`hashing`), the
KV cache manager (`kv_cache_manager`), the scheduler (`scheduler`, `request_queue`,
`scheduler_output`), vLLM's KV-cache events (`events`), capacity sizing (`capacity`) and the
books of the offloaded tiers (`offloading`: the CPU tier's manager and its `lru`/`arc` policies).
Deterministic and I/O-free: it imports no Redis, aiohttp, torch and nothing of kvledger's
other packages (checked by the import contracts in pyproject.toml). The service that runs it
behind Redis Streams is `engine/`.
"""
