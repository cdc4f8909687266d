"""The offloaded tiers' books, exact to vLLM 0.33's OffloadingConnector (scheduler side).

`base` (keys, chunks, request contexts, events), `policies` (`lru`, `arc`), `manager` (the CPU
tier's CPUOffloadingManager) and `events` (the tier's changes as vLLM's KV events). Pure: the
ledger decides and books; the workers move the bytes.
"""
