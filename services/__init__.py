"""What every kvledger service shares (the common layer): configuration (`config`), the wire
messages and their msgpack codec (`messages`, `wire`), the Redis Streams transport
(`transport`), worker registration (`registry`), tokenization (`tokenizer`), a private
redis-server (`redis_server`) and the KV-events subscriber for routers (`subscriber`).

It imports only the ledger core below it, never a role (ledger.service, gateway, gpu_worker,
kernels) or the application (kvledger).
"""
