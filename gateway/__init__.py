"""The gateway: kvledger's OpenAI-compatible HTTP API. It validates and tokenizes requests,
enqueues them for the ledger over Redis Streams, and streams the tokens back.
"""

from __future__ import annotations

from gateway.app import create_app, serve
from gateway.state import GATEWAY

__all__ = ["GATEWAY", "create_app", "serve"]
