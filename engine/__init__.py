"""The ledger's service (the role `kvledger ledger` runs): the ledger core behind Redis Streams.

`process` waits for the replica's lease and its workers, then builds the `engine`, whose one
loop owns the core's state; `translate` turns wire messages into core requests and scheduler
outputs into step messages; `intake` reads the requests, `step_results` the workers' sampled
tokens, `outputs` streams tokens to the gateways; `event_stream` publishes the KV events and
their snapshot; `workers` sizes the pool from the workers' reports; `leadership` holds the
lease and fences every write; `quarantine` fails requests that keep failing steps;
`telemetry` turns scheduler outputs into spans and metrics; `http` serves /metrics and /health.
"""

from engine.process import serve

__all__ = ["serve"]
