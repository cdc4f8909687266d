"""The shared KV tier's common parts: its namespace, its blocks' bytes and its catalog in Redis."""
