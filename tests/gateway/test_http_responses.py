"""/v1/responses through real HTTP against the fake ledger: text and item inputs rendered by the
chat template (instructions first), the response object and its usage, the stream's events in
vLLM's order, text.format constraining the output, tool calls as function_call items,
max_output_tokens capped and "incomplete", every refused field named, and the Redis store
(--enable-responses-store): a stored response read back by another gateway, continued with
previous_response_id, gone after its time to live."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from services.tokenization.tokenizer import ByteTokenizer, HFTokenizer
from tests.gateway.fake_ledger import TEXT, Script
from tests.gateway.helpers import assert_error
from tests.gpu_worker.tool_checkpoints import FORMATS, tool_tokenizer

BYTES = ByteTokenizer()


async def read_events(resp) -> list[dict[str, Any]]:
    """A Responses stream: `event: <type>` and `data: <json>` per event, no [DONE]."""
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = []
    for block in (await resp.text()).split("\n\n"):
        if not block:
            continue
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == kind.removeprefix("event: ")
        events.append(event)
    return events


async def _create(client, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/responses", json=body)
    text = await resp.text()
    assert resp.status == 200, text
    return json.loads(text)


async def test_text_input_with_instructions(start_gateway, start_ledger):
    ledger = await start_ledger(Script(eos_after=5, cached_tokens=2), max_model_len=256)
    client = await start_gateway()
    body = await _create(client, input="Hi", instructions="Be brief.", max_output_tokens=20,
                         metadata={"k": "v"}, temperature=0.5)  # fmt: skip
    (req,) = ledger.requests
    prompt = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert req.prompt_token_ids == BYTES.encode(prompt)
    assert req.sampling.max_tokens == 20 and req.sampling.temperature == 0.5
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == "completed" and body["incomplete_details"] is None
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["status"] == "completed" and item["id"].startswith("msg_")
    assert item["content"] == [
        {"annotations": [], "text": TEXT[:5], "type": "output_text", "logprobs": None}
    ]
    assert (body["instructions"], body["metadata"], body["max_output_tokens"]) == (
        "Be brief.", {"k": "v"}, 20,
    )  # fmt: skip
    assert body["usage"] == {
        "input_tokens": len(req.prompt_token_ids),
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": 6,  # five characters and EOS
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": len(req.prompt_token_ids) + 6,
    }  # fmt: skip


async def test_item_input_continues_an_unfinished_assistant_message(start_gateway, start_ledger):
    ledger = await start_ledger(Script(eos_after=2))
    client = await start_gateway()
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "Sure"}]},
    ]  # fmt: skip
    await _create(client, input=items)
    prompt = "<|user|>\nHi\n<|assistant|>\nSure"  # no generation prompt: it continues
    assert ledger.requests[0].prompt_token_ids == BYTES.encode(prompt)


async def test_max_output_tokens_past_the_context_is_capped_and_a_cut_answer_incomplete(
    start_gateway, start_ledger
):
    ledger = await start_ledger(max_model_len=64)
    client = await start_gateway()
    body = await _create(client, input="Hi", max_output_tokens=1000)
    prompt_len = len(ledger.requests[0].prompt_token_ids)
    assert ledger.requests[0].sampling.max_tokens == 64 - prompt_len  # capped, as vLLM
    assert body["max_output_tokens"] == 64 - prompt_len
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"


async def test_the_stream_is_vllms_event_sequence(start_gateway, start_ledger):
    await start_ledger(Script(eos_after=4))
    client = await start_gateway()
    resp = await client.post("/v1/responses", json={"input": "Hi", "stream": True})
    events = await read_events(resp)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 4,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["usage"] is None
    )
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == TEXT[:4]
    done = events[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == TEXT[:4]
    assert done["output"][0]["id"] == events[2]["item"]["id"]
    assert done["usage"]["output_tokens"] == 5 and done["id"] == events[0]["response"]["id"]


async def test_text_format_json_schema_constrains_the_output(start_gateway, start_ledger):
    ledger = await start_ledger(Script(eos_after=3))
    client = await start_gateway()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"format": {"type": "json_schema", "name": "obj", "schema": schema}}
    body = await _create(client, input="Hi", text=fmt)
    constraint = ledger.requests[0].sampling.structured
    assert constraint is not None and constraint.kind == "json"
    assert body["text"] == fmt


REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"store": True}, "store", "--enable-responses-store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "--enable-responses-store"),
    ({"background": True}, "background", "not supported"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "only message.output_text"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "only input_text"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema", "JSON schema"),
    ({"input": None}, "input", "'input' is required"),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"truncation": "sometimes"}, "truncation", "auto or disabled"),
    ({"conversation": "c1"}, "conversation", "unknown field"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "fragment"), REFUSED)
async def test_refused_fields_are_named(start_gateway, start_ledger, extra, param, fragment):
    ledger = await start_ledger()
    client = await start_gateway()
    resp = await client.post("/v1/responses", json={"input": "Hi", **extra})
    assert resp.status == 400
    body = await resp.json()
    assert_error(body, param, fragment)
    assert body["error"]["type"] == "BadRequestError"
    assert ledger.requests == []


async def test_tool_calls_are_function_call_items(start_gateway, start_ledger, tmp_path):
    folder = tool_tokenizer(tmp_path, "hermes")
    text = FORMATS["hermes"].call_text([("get_time", {"zone": "UTC"})], "Let me see. ")
    ids = HFTokenizer(folder).encode(text, add_special_tokens=False)
    await start_ledger(Script(ids=ids, eos=1), vocab_size=320, max_model_len=4096)
    client = await start_gateway(model=str(folder), tool_call_parser="hermes",
                                 enable_auto_tool_choice=True)  # fmt: skip
    tools = [{"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
    body = await _create(client, input="Time?", tools=tools)
    message, call = body["output"]
    assert message["content"][0]["text"] == "Let me see. "
    assert call["type"] == "function_call" and call["name"] == "get_time"
    assert json.loads(call["arguments"]) == {"zone": "UTC"} and call["status"] == "completed"
    assert call["call_id"].startswith("chatcmpl-tool-") and call["id"].startswith("fc_")
    assert body["tools"] == tools and body["tool_choice"] == "auto"
    resp = await client.post("/v1/responses", json={"input": "Time?", "tools": tools,
                                                    "stream": True})  # fmt: skip
    events = await read_events(resp)
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == 2
    arguments = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    assert json.loads(arguments) == {"zone": "UTC"}
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["name"] == "get_time" and json.loads(done["arguments"]) == {"zone": "UTC"}
    assert events[-1]["response"]["output"][1]["name"] == "get_time"


async def test_the_redis_store_serves_every_gateway_and_expires(start_gateway, start_ledger, redis):
    ledger = await start_ledger(Script(eos_after=3))
    one = await start_gateway(enable_responses_store=True, responses_store_ttl_s=1.5)
    other = await start_gateway(enable_responses_store=True, gateway_id="gw-other")
    first = await _create(one, input="Hi", instructions="Be brief.")  # stored by default, as vLLM
    got = await other.get(f"/v1/responses/{first['id']}")
    assert got.status == 200 and await got.json() == first
    # Continued from the other gateway: the conversation so far, then the new input
    # (the earlier instructions are not carried, as OpenAI's and vLLM's).
    second = await _create(other, input="More?", previous_response_id=first["id"], store=False)
    prompt = f"<|user|>\nHi\n<|assistant|>\n{TEXT[:3]}\n<|user|>\nMore?\n<|assistant|>\n"
    assert ledger.requests[-1].prompt_token_ids == BYTES.encode(prompt)
    assert second["previous_response_id"] == first["id"]
    unstored = await other.get(f"/v1/responses/{second['id']}")
    assert unstored.status == 404  # store: false
    await asyncio.sleep(1.8)
    gone = await one.get(f"/v1/responses/{first['id']}")
    assert gone.status == 404
    assert_error(await gone.json(), "response_id", f"Response with id '{first['id']}' not found.")
    resp = await one.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]})
    assert resp.status == 404
