"""The ledger service: the ledger core behind Redis Streams (a role).

`engine` runs the one engine loop that owns the core's state; `translate` turns wire messages
into core requests and scheduler outputs into step messages; `step_results` collects the
workers' sampled tokens; `event_stream` publishes the KV events and their snapshot; `workers`
sizes the pool from the workers' reports; `telemetry` turns scheduler outputs into spans and
metrics; `http` serves the ledger's /metrics and /health.
"""
