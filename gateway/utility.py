"""The utility endpoints vLLM serves beside generation: /tokenize, /detokenize, /version, /ping,
GET /v1/models/{model_id} and /openapi.json.

/tokenize and /detokenize read their body under the same deadline as generation
(--body-timeout-s, 408 past it). As in vLLM, which guards only /v1, they need no API key.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from aiohttp import web

from gateway.chat import read_chat_prompt
from gateway.fields import (
    bad_request,
    read_bool,
    read_model,
    read_token_ids,
    unknown_model,
)
from gateway.generate import read_body
from gateway.openapi import openapi_document
from gateway.protocol import parse_json
from gateway.state import PROBE_MAX_AGE_S, Gateway
from gateway.support import DETOKENIZE_FIELDS, TOKENIZE_FIELDS, check_fields
from gateway.tools import read_tools
from services.tokenization.tokenizer import ChatTemplateError

# vLLM's TokenizeChatRequest: fields only the chat form takes.
CHAT_ONLY_FIELDS = (
    "messages", "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs", "tools", "media_io_kwargs", "mm_processor_kwargs",
)  # fmt: skip


def add_utility_routes(app: web.Application, gateway_key: web.AppKey[Gateway]) -> None:
    async def tokenize(request: web.Request) -> web.Response:
        gw = request.app[gateway_key]
        body = parse_json(await read_body(request, gw.config.body_timeout_s))
        limits = gw.limits(await gw.ledger_status())
        _check_model(body, limits.model_name)
        ids = await asyncio.to_thread(_tokenize, gw, body)
        strs = gw.tokenizer.token_pieces(ids) if read_bool(body, "return_token_strs") else None
        return web.json_response(
            {
                "count": len(ids),
                "max_model_len": limits.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(request: web.Request) -> web.Response:
        gw = request.app[gateway_key]
        body = parse_json(await read_body(request, gw.config.body_timeout_s))
        check_fields(body, DETOKENIZE_FIELDS)
        limits = gw.limits(await gw.ledger_status())
        _check_model(body, limits.model_name)
        if body.get("tokens") is None:
            raise bad_request("'tokens' is required", "tokens")
        ids = read_token_ids(body["tokens"], "tokens")
        bad = next((i for i in ids if i >= limits.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} in 'tokens' is out of the vocabulary "
                f"(ids 0..{limits.vocab_size - 1})",
                "tokens",
            )
        text = gw.tokenizer.decode(ids, skip_special_tokens=False)
        return web.json_response({"prompt": text})

    async def model_card(request: web.Request) -> web.Response:
        gw = request.app[gateway_key]
        limits = gw.limits(await gw.ledger_status(max_age_s=0))
        model_id = request.match_info["model_id"]
        if model_id != limits.model_name:
            raise unknown_model(model_id, limits.model_name)
        return web.json_response(model_body(gw, limits.model_name, limits.max_model_len))

    async def show_version(_: web.Request) -> web.Response:
        return web.json_response({"version": kvledger_version()})

    async def ping(request: web.Request) -> web.Response:
        # vLLM's /ping is its /health: 200 with an empty body while the engine can serve.
        gw = request.app[gateway_key]
        status = await gw.ledger_status(max_age_s=PROBE_MAX_AGE_S)
        ready = status is not None and status.num_workers and gw.routing.not_ready() is None
        return web.Response(status=200 if ready else 503)

    async def openapi(_: web.Request) -> web.Response:
        return web.json_response(openapi_document(kvledger_version()))

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models/{model_id}", model_card)
    app.router.add_get("/version", show_version)
    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)
    app.router.add_get("/openapi.json", openapi)


def model_body(gw: Gateway, name: str, max_model_len: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(gw.started_at),
        "owned_by": "kvledger",
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
    }


def kvledger_version() -> str:
    try:
        return version("kvledger")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def _check_model(body: dict[str, Any], served: str) -> None:
    model = read_model(body.get("model"))
    if model is not None and model != served:
        raise unknown_model(model, served)


def _tokenize(gw: Gateway, body: dict[str, Any]) -> list[int]:
    check_fields(body, TOKENIZE_FIELDS)
    if "prompt" in body:  # the completion form wins, as vLLM's union tries it first
        chat_fields = [f for f in CHAT_ONLY_FIELDS if f in body]
        if chat_fields:
            raise bad_request(
                f"'{chat_fields[0]}' belongs to the chat form of /tokenize; send either "
                "'prompt' or 'messages'",
                chat_fields[0],
            )
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt")
        add_special = read_bool(body, "add_special_tokens", default=True)
        return gw.tokenizer.encode(prompt, add_special_tokens=add_special)
    if "messages" not in body:
        raise bad_request("/tokenize needs 'prompt' (text) or 'messages' (chat)", "prompt")
    tools = read_tools({"tools": body.get("tools"), "tool_choice": "none"}, gw.tool_settings)
    chat = read_chat_prompt(body, tools.tools if tools is not None else None)
    try:
        return gw.tokenizer.apply_chat_template(chat.messages, chat.options)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
