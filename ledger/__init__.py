"""The ledger: vLLM's KV-cache bookkeeping, in two layers.

`ledger.core` is the library (block pool, prefix cache, KV cache manager, scheduler, KV events,
capacity sizing): plain Python that never imports Redis, aiohttp, torch or any service code.
`ledger.service` is the ledger service: the thin shell that runs the core behind Redis Streams.
"""
