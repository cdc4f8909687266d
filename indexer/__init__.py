"""`kvledger indexer`: the replicas' KV events as a score service for external routers."""

from indexer.app import create_app, serve

__all__ = ["create_app", "serve"]
