"""What every kvledger service shares (the common layer), one package per concept:

- `wire`: the typed messages that cross Redis and their msgpack codec;
- `transport`: Redis (clients, a private redis-server, key names, the streams transport, worker
  registration);
- `events`: KV-cache events as a reader sees them (the subscriber, the `hashes` runs, the
  snapshot and checkpoint formats);
- `routing`: the routing policy and a live view of every replica (pure scoring over events);
- `tokenization`: the model's tokenizer and chat template;
- `config`, `environment`, `startup`, `http_server`: settings, the environment variables, a
  service's start-up, and the limits every HTTP server keeps.

It imports only the ledger core below it, never a role (engine, gateway, gpu_worker, indexer,
kernels) or the application (kvledger).
"""
