"""KV-cache events as a reader sees them: the subscriber that follows a replica's stream from a
snapshot (`subscriber`), the `hashes` runs the ledger writes beside vLLM's bytes (`runs`), and
the binary snapshot and checkpoint formats of a prefix index (`snapshot`).
"""
