"""How accepted requests end when things go wrong (timeouts, disconnects, ledger errors,
shutdown), each telling the ledger with an AbortRequest, plus /v1/models, /health, /metrics,
the request span and serve()."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.web import AppRunner, TCPSite
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway import create_app, serve
from gateway.state import PROBE_MAX_AGE_S
from observability import Attr, LedgerSnapshot
from services.transport import redis_streams
from services.transport.keys import StreamNames
from services.transport.redis_server import RedisServer, free_port
from services.wire.messages import AbortRequest, OutputBatch, RequestOutput
from tests.gateway.fake_ledger import TEXT, Script, request_stream
from tests.gateway.helpers import GATEWAY_ID, assert_error, read_sse


async def test_silent_ledger_times_out_with_504_and_an_abort(start_gateway, start_ledger):
    ledger = await start_ledger(Script(silent=True))
    client = await start_gateway(request_timeout_s=0.3)
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 504
    body = await resp.json()
    assert_error(body, None, "no output from the ledger for 0.3s")
    assert body["error"]["type"] == "Gateway Timeout"
    (req,) = ledger.requests
    assert (await ledger.wait_for_abort(req.req_id)).reason == "timeout"


async def test_streamed_timeout_ends_with_an_error_event_and_done(start_gateway, start_ledger):
    ledger = await start_ledger(Script(silent=True))
    client = await start_gateway(request_timeout_s=0.3)
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert resp.status == 200  # the headers went out before the timeout
    error, done = await read_sse(resp)
    assert error["error"]["type"] == "Gateway Timeout" and error["error"]["code"] == 504
    assert done == "[DONE]"
    await ledger.wait_for_abort(ledger.requests[0].req_id)


async def test_ledger_error_gives_500_with_its_message(start_gateway, start_ledger):
    ledger = await start_ledger(Script(error="worker lost", error_after=2))
    client = await start_gateway()
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 500
    assert_error(await resp.json(), None, "the ledger failed the request: worker lost")
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    *chunks, error, done = await read_sse(resp)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "He"
    assert error["error"]["message"] == "the ledger failed the request: worker lost"
    assert done == "[DONE]"
    assert ledger.aborts == []  # the ledger ended those requests itself


async def test_client_disconnect_while_streaming_aborts_the_request(start_gateway, start_ledger):
    ledger = await start_ledger(Script(delay_s=0.05))
    client = await start_gateway()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            client.make_url("/v1/completions"),
            json={"prompt": "x", "max_tokens": 50, "stream": True},
        )
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()  # hang up mid-stream
    (req,) = ledger.requests
    assert (await ledger.wait_for_abort(req.req_id)).reason == "client_disconnected"


async def test_client_disconnect_is_noticed_without_handler_cancellation(make_config, start_ledger):
    # A plain AppRunner (as web.run_app) keeps handlers running after a hang-up: the gateway
    # must still notice, through its poll of the connection.
    ledger = await start_ledger(Script(delay_s=0.1))
    runner = AppRunner(create_app(make_config()), handler_cancellation=False)
    await runner.setup()
    port = free_port()
    await TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            post = session.post(
                f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 60}
            )
            task = asyncio.ensure_future(post)
            (req,) = await ledger.wait_for_requests(1)
            task.cancel()
        abort = await ledger.wait_for_abort(req.req_id, timeout=3.0)
        assert abort.reason == "client_disconnected"
    finally:
        await runner.cleanup()


async def test_shutdown_ends_in_flight_requests_and_aborts_them(
    make_config, start_ledger, redis, prefix
):
    ledger = await start_ledger(Script(delay_s=0.05))
    server = TestServer(create_app(make_config()))
    await server.start_server()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            server.make_url("/v1/completions"),
            json={"prompt": "x", "max_tokens": 60, "stream": True},
        )
        assert (await resp.content.readline()).startswith(b"data: ")
        closing = asyncio.ensure_future(server.close())
        rest = (await resp.content.read()).decode()
        await closing
    assert '"type":"ServiceUnavailableError"' in rest and rest.endswith("data: [DONE]\n\n")
    (req,) = ledger.requests
    assert AbortRequest(req.req_id, "gateway_shutdown") in await request_stream(redis, prefix)


async def test_outputs_for_unknown_requests_and_garbage_are_ignored(
    start_gateway, start_ledger, redis, prefix
):
    await start_ledger()
    client = await start_gateway()
    streams = StreamNames(prefix)
    outputs = streams.outputs(GATEWAY_ID)
    gone = RequestOutput("cmpl-gone", [1, 2], finished=True)
    await redis_streams.append(redis, outputs, OutputBatch(outputs=[gone]))
    await redis.xadd(outputs, {b"m": b"not msgpack at all"})
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    assert (await resp.json())["choices"][0]["text"] == TEXT[:4]
    dead = await redis.xrange(streams.dead_letters)
    assert len(dead) == 1 and dead[0][1][b"source_stream"] == outputs.encode()
    metrics = await (await client.get("/metrics")).text()
    assert f'kvledger:dead_letters_total{{stream="{outputs}"}} 1.0' in metrics


async def test_models_serves_the_ledgers_model_name(start_gateway, start_ledger):
    client = await start_gateway()
    card = (await (await client.get("/v1/models")).json())["data"][0]
    assert card["id"] == "kvledger-tiny-llama"  # no ledger yet: the tokenizer's name
    await start_ledger(model_name="served-name", max_model_len=99)
    body = await (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == ("served-name", "model", 99)


async def test_health_reports_the_ledger_or_503(start_gateway, start_ledger):
    client = await start_gateway()
    resp = await client.get("/health")
    assert resp.status == 503
    body = await resp.json()
    assert body["status"] == "unavailable" and "no ledger is running" in body["message"]
    await start_ledger()
    # /health answers from a status read at most PROBE_MAX_AGE_S ago: the ledger shows by then.
    deadline = asyncio.get_running_loop().time() + PROBE_MAX_AGE_S + 2.0
    while (resp := await client.get("/health")).status != 200:
        assert asyncio.get_running_loop().time() < deadline, await resp.text()
        await asyncio.sleep(0.1)
    body = await resp.json()
    assert body["status"] == "ok" and body["gateway_id"] == GATEWAY_ID
    assert body["ledger"]["model_name"] == "fake-model"
    assert body["ledger"]["capacity_line"] == "KV cache size: 1600 tokens"


async def test_an_unreadable_status_key_counts_as_no_ledger(start_gateway, redis, prefix):
    await redis.set(StreamNames(prefix).ledger_status, b"\x93garbage", px=5000)
    client = await start_gateway()
    assert (await client.get("/health")).status == 503
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 503


async def test_a_gateway_started_before_its_redis_waits_for_it_then_serves(make_config):
    port = free_port()
    server = TestServer(create_app(make_config(redis_url=f"redis://127.0.0.1:{port}/0")))
    starting = asyncio.create_task(server.start_server())
    redis = None
    try:
        await asyncio.sleep(1.5)  # several backoff rounds (50 ms doubling)
        assert not starting.done(), "the gateway gave up (or started) without Redis"
        redis = RedisServer(port=port).start()
        await asyncio.wait_for(starting, timeout=15)
        async with TestClient(server) as client:
            resp = await client.get("/health")
            # Redis answers; no ledger has written its status there: unavailable, not a crash.
            assert resp.status == 503
            body = await resp.json()
            assert body["status"] == "unavailable" and "no ledger is running" in body["message"]
            metrics = await (await client.get("/metrics")).text()
            assert 'kvledger:redis_outages_total{loop="startup"} 1.0' in metrics, metrics
    finally:
        starting.cancel()
        await server.close()
        if redis is not None:
            redis.stop()


async def test_metrics_show_requests_and_the_mirrored_ledger(start_gateway, start_ledger):
    snapshot = LedgerSnapshot(kv_cache_usage=0.25, num_preemptions=3, prefix_cache_hits=48)
    await start_ledger(metrics=snapshot.to_dict())
    client = await start_gateway()
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stop": "e"})
    resp = await client.get("/metrics")
    assert resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    labels = 'engine="0",model_name="kvledger-tiny-llama"'
    assert f"vllm:time_to_first_token_seconds_count{{{labels}}} 2.0" in text
    assert f"vllm:e2e_request_latency_seconds_count{{{labels}}} 2.0" in text
    assert f"vllm:generation_tokens_total{{{labels}}} 5.0" in text
    for reason in ("length", "stop"):
        success = f'engine="0",finished_reason="{reason}",model_name="kvledger-tiny-llama"'
        assert f"vllm:request_success_total{{{success}}} 1.0" in text
    assert f"vllm:kv_cache_usage_perc{{{labels}}} 0.25" in text
    assert f"vllm:num_preemptions_total{{{labels}}} 3.0" in text
    assert f"vllm:prefix_cache_hits_total{{{labels}}} 48.0" in text


async def test_request_span_is_a_root_server_span_beside_a_genai_span(make_config, start_ledger):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ledger = await start_ledger(Script(cached_tokens=2, queued_s=0.25))
    app = create_app(make_config(), tracer=provider.get_tracer("test"))
    async with TestClient(TestServer(app)) as client:
        resp = await client.post(
            "/v1/completions",
            json={"prompt": "abc", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 4},
        )
        assert resp.status == 200
        body = await resp.json()
    genai, server = exporter.get_finished_spans()
    assert server.name == "POST /v1/completions" and server.kind == SpanKind.SERVER
    assert server.parent is None
    assert server.attributes[Attr.REQUEST_ID] == ledger.requests[0].req_id
    assert server.attributes["http.response.status_code"] == 200
    # The GenAI span, named by the conventions, is the server span's child...
    assert genai.name == "text_completion fake-model" and genai.kind == SpanKind.INTERNAL
    assert genai.parent.span_id == server.context.span_id
    a = genai.attributes
    assert {
        k: a[k]
        for k in a
        if k.startswith(
            (
                "gen_ai.request",
                "gen_ai.response",
                "gen_ai.usage",
                "gen_ai.provider",
                "gen_ai.operation",
            )
        )
    } == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "kvledger",
        "gen_ai.request.model": "fake-model",
        "gen_ai.request.max_tokens": 3,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.seed": 4,
        "gen_ai.request.stream": False,
        "gen_ai.request.n": 1,  # vLLM's
        "gen_ai.request.id": body["id"],  # vLLM's
        "gen_ai.response.id": body["id"],
        "gen_ai.response.model": "fake-model",
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": 4,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.usage.cache_read.input_tokens": 2,
        "gen_ai.usage.prompt_tokens": 4,  # vLLM's names
        "gen_ai.usage.completion_tokens": 3,
    }
    # ... with vLLM's latency breakdown: the ledger's queue time, then the gateway's clock.
    assert a["gen_ai.latency.time_in_queue"] == 0.25
    latency = {k: a[k] for k in a if k.startswith("gen_ai.latency.")}
    assert set(latency) == {
        "gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token",
        "gen_ai.latency.e2e", "gen_ai.latency.time_in_model_prefill",
        "gen_ai.latency.time_in_model_decode", "gen_ai.latency.time_in_model_inference",
    }  # fmt: skip
    assert 0 < latency["gen_ai.latency.time_to_first_token"] <= latency["gen_ai.latency.e2e"]
    # ... and the trace the ledger joins: its requests carry the GenAI span's traceparent.
    trace_id = f"{genai.context.trace_id:032x}"
    span_id = f"{genai.context.span_id:016x}"
    assert ledger.requests[0].traceparent.startswith(f"00-{trace_id}-{span_id}-")


async def test_n_choices_report_a_finish_reason_each(make_config, start_ledger):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ledger = await start_ledger(Script(eos_after=2, vary_by_seed=True))
    app = create_app(make_config(), tracer=provider.get_tracer("test"))
    async with TestClient(TestServer(app)) as client:
        resp = await client.post(
            "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "n": 2, "seed": 1}
        )
        assert resp.status == 200
    genai, _ = exporter.get_finished_spans()
    a = genai.attributes
    assert a["gen_ai.response.finish_reasons"] == ("stop", "stop")
    assert (a["gen_ai.request.choice.count"], a["gen_ai.request.n"]) == (2, 2)
    assert list(a[Attr.REQUEST_IDS]) == [r.req_id for r in ledger.requests]
    assert a["gen_ai.usage.output_tokens"] == 6  # 2 tokens and EOS, twice


async def test_serve_runs_until_cancelled(make_config, start_ledger):
    await start_ledger()
    port = free_port()
    task = asyncio.create_task(serve(make_config(port=port)))
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            try:
                async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                    assert resp.status == 200
                    break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("serve() never answered /health")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.done()
    async with aiohttp.ClientSession() as session:
        try:
            await session.get(f"http://127.0.0.1:{port}/health")
            raise AssertionError("the gateway still listens after serve() was cancelled")
        except aiohttp.ClientConnectionError:
            pass


@pytest.mark.parametrize(
    "error",
    [
        "field 'sampling.temperature': must be a finite number, got nan",
        "the worker failed on this request: RuntimeError: probability tensor contains nan",
    ],
)
async def test_a_ledger_error_the_request_caused_gives_400(start_gateway, start_ledger, error):
    await start_ledger(Script(error=error))
    client = await start_gateway()
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 400
    body = await resp.json()
    assert_error(body, None, f"the ledger failed the request: {error}")
    assert body["error"]["type"] == "BadRequestError"


async def _forget_everything(redis, prefix: str) -> None:
    """What a Redis restarted without its data looks like to this test's keys."""
    keys = [key async for key in redis.scan_iter(match=f"{prefix}*")]
    if keys:
        await redis.delete(*keys)


async def test_redis_data_loss_fails_the_requests_it_lost_and_no_later_one(
    start_gateway, start_ledger, redis, prefix
):
    # A request sent before Redis lost its data was lost with it: it fails at once, with a 503
    # the client may retry. One sent after, to the emptied Redis, is served: the gateway learns
    # of the loss from the request that finds its marker gone, not from a timer that would fail
    # every request waiting when it ticks, those that Redis did keep included.
    ledger = await start_ledger(Script(delay_s=0.15))
    client = await start_gateway(request_timeout_s=20.0)
    body = {"prompt": "x", "max_tokens": 8}
    before = asyncio.ensure_future(client.post("/v1/completions", json=body))
    while not ledger.requests:
        await asyncio.sleep(0.01)
    await _forget_everything(redis, prefix)
    after = asyncio.ensure_future(client.post("/v1/completions", json=body))
    lost, kept = await before, await after
    assert lost.status == 503, await lost.text()
    assert lost.headers["Retry-After"] == "1"
    assert_error(await lost.json(), None, "Redis restarted without its data")
    assert kept.status == 200, await kept.text()
    assert (await kept.json())["choices"][0]["text"] == TEXT[:8]
    assert len(ledger.requests) == 2
