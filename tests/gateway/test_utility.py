"""The utility endpoints (/tokenize, /detokenize, /version, /ping, /v1/models/{id},
/openapi.json), /health's settings, and `--help` showing every flag's default."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import jsonschema
import pytest

from gateway.openapi import FIELD_SCHEMAS
from gateway.state import PROBE_MAX_AGE_S
from gateway.support import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    STRUCTURED_OUTPUTS_FIELDS,
    TOKENIZE_FIELDS,
)
from services.tokenization.tokenizer import ByteTokenizer
from tests.gateway.helpers import assert_error

BOS = ByteTokenizer.BOS_ID
CHAT = [{"role": "user", "content": "Hi"}]


async def test_tokenize_a_prompt_and_a_chat(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    resp = await client.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True})
    assert await resp.json() == {
        "count": 3, "max_model_len": 64, "tokens": [BOS, *b"Hi"], "token_strs": ["<s>", "H", "i"]
    }  # fmt: skip
    resp = await client.post("/tokenize", json={"prompt": "Hi", "add_special_tokens": False})
    assert (await resp.json())["tokens"] == [*b"Hi"]
    resp = await client.post("/tokenize", json={"messages": CHAT})
    assert (await resp.json())["tokens"] == ByteTokenizer().apply_chat_template(CHAT)


async def test_detokenize_and_its_errors(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    resp = await client.post("/detokenize", json={"tokens": [BOS, *b"Hi"]})
    assert await resp.json() == {"prompt": "<s>Hi"}
    resp = await client.post("/detokenize", json={"tokens": [300]})
    assert resp.status == 400
    assert_error(await resp.json(), "tokens", "out of the vocabulary")
    resp = await client.post("/detokenize", json={"tokens": [1], "model": "other"})
    assert resp.status == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "messages": CHAT}, "messages"),
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
    ],
)
async def test_tokenize_refuses_what_it_cannot_do(start_gateway, start_ledger, body, param):
    await start_ledger()
    client = await start_gateway()
    resp = await client.post("/tokenize", json=body)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param


async def test_version_ping_and_model_card(start_gateway, start_ledger):
    ledger = await start_ledger()
    client = await start_gateway()
    assert (await (await client.get("/version")).json())["version"]
    assert (await client.get("/ping")).status == 200
    assert (await client.post("/ping")).status == 200
    card = await (await client.get("/v1/models/fake-model")).json()
    assert (card["id"], card["object"], card["max_model_len"]) == ("fake-model", "model", 64)
    models = await (await client.get("/v1/models")).json()
    assert models["data"] == [card]
    assert (await client.get("/v1/models/nope")).status == 404
    await ledger.__aexit__(None, None, None)
    # Probes answer from a status read within PROBE_MAX_AGE_S: the ledger's loss shows within it.
    deadline = time.monotonic() + PROBE_MAX_AGE_S + 5
    while (await client.get("/ping")).status == 200:
        assert time.monotonic() < deadline, "/ping never said 503"
        await asyncio.sleep(0.05)


async def test_health_shows_the_active_settings(start_gateway, start_ledger):
    await start_ledger(scheduling_policy="priority")
    client = await start_gateway(model_name="served-name")
    body = await (await client.get("/health")).json()
    assert body["settings"]["served_model_name"] == "served-name"
    assert body["ledger"]["scheduling_policy"] == "priority"
    assert body["ledger"]["hash_algo"] == "sha256"
    assert "async_scheduling" in body["ledger"]
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "served-name"  # the served name beats the ledger's


async def test_openapi_describes_every_route_and_every_field(start_gateway, start_ledger):
    await start_ledger()
    client = await start_gateway()
    doc = await (await client.get("/openapi.json")).json()
    routes = {
        (method.upper(), resource.canonical)
        for resource in client.app.router.resources()
        for route in resource
        if (method := route.method) != "HEAD"
    }
    documented = {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops}
    assert routes <= documented, routes - documented
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert set(body["schema"]["properties"]) == set(COMPLETION_FIELDS)
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert set(chat["content"]["application/json"]["schema"]["properties"]) == set(CHAT_FIELDS)
    for table in (COMPLETION_FIELDS, CHAT_FIELDS, TOKENIZE_FIELDS, DETOKENIZE_FIELDS):
        assert set(table) <= set(FIELD_SCHEMAS)


STRUCTURED_BODIES = [  # (body, accepted by the gateway)
    ({"structured_outputs": {"regex": "[a-z]{3}"}}, True),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}}, True),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, True),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        True,
    ),
    ({"response_format": {"type": "json_object"}}, True),
    ({"response_format": {"type": "text"}}, True),
    ({"structured_outputs": {"regex": 3}}, False),
    ({"structured_outputs": {"choice": []}}, False),
    ({"structured_outputs": {"json_object": False}}, False),
    ({"structured_outputs": {"regexp": "a"}}, False),
    ({"response_format": {"type": "json_schema"}}, False),
    ({"response_format": {"type": "yaml"}}, False),
]


async def test_openapi_describes_structured_outputs_and_response_format_by_key(
    start_gateway, start_ledger
):
    """The document's schema for the two fields says what the gateway does: bodies it accepts
    validate, bodies it answers with a 400 do not (checked against the gateway itself)."""
    await start_ledger()
    client = await start_gateway()
    doc = await (await client.get("/openapi.json")).json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    schema = body["schema"]
    options = schema["properties"]["structured_outputs"]
    assert set(options["properties"]) == set(STRUCTURED_OUTPUTS_FIELDS)
    assert options["properties"]["structural_tag"]["description"].startswith("Refused")
    for extra, accepted in STRUCTURED_BODIES:
        request = {"prompt": "x", "max_tokens": 2, **extra}
        valid = jsonschema.Draft202012Validator(schema).is_valid(request)
        resp = await client.post("/v1/completions", json=request)
        assert valid == accepted, (extra, valid)
        assert (resp.status == 200) == accepted, (extra, resp.status, await resp.text())


COMMANDS = ["up", "ledger", "worker", "gateway", "hash", "capacity", "simulate", "events"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_every_command_shows_its_default(command):
    out = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", command, "--help"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    options = out.split("options:", 1)[1]
    # One entry per flag: a line starting with "  --", continued by deeper-indented lines.
    entries = [e for e in options.split("\n  -") if e.strip() and not e.startswith("h, --help")]
    assert entries
    for entry in entries:
        flat = " ".join(entry.split())
        assert "(default" in flat or "(required)" in flat, flat


def test_the_settings_the_issue_names_are_flags_of_up_and_the_services():
    up = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "up", "--help"], capture_output=True, text=True
    ).stdout
    ledger = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "ledger", "--help"], capture_output=True, text=True
    ).stdout
    for flag in ("--scheduling-policy", "--hash-algo", "--async-scheduling", "--served-model-name"):
        assert flag in up
    for flag in ("--scheduling-policy", "--hash-algo", "--async-scheduling"):
        assert flag in ledger
