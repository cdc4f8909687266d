"""A poison request through HTTP: on `kvledger up`'s real processes, a completion the worker
cannot sample gets an explicit error (a 400 body naming the cause, or an error event ending its
stream) while the completions sent with it, streamed and not, get the dense model's exact
tokens; the ledger frees every block and goes on serving."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp

from gpu_worker.checkpoint import load_model
from tests.e2e.conftest import metric_value, serve
from tests.e2e.test_traces import complete, token_prompts
from tests.harness.stack import dense_greedy

MAX_TOKENS = 12


def poison_body(stream: bool) -> dict:
    # Valid for vLLM and the gateway (> 0, finite), but 0 in float32: the worker divides the
    # prompt's positive logits into +inf and fails in torch.multinomial. The gateway cannot
    # see it coming; the worker must name the request that failed.
    return {
        "prompt": "poison: the KV cache pages",
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": 3,
        "repetition_penalty": 1e-300,
        "stream": stream,
    }


async def send_poison(session: aiohttp.ClientSession, url: str, stream: bool) -> tuple[int, dict]:
    """(status, the error object): the body's for a whole answer, the error event's for a stream."""
    async with session.post(f"{url}/v1/completions", json=poison_body(stream)) as resp:
        if not stream or resp.status != 200:
            return resp.status, (await resp.json())["error"]
        errors, done = [], False
        async for raw in resp.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
        assert done and len(errors) == 1, (done, errors)
        return resp.status, errors[0]


def ledger_metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def test_a_poison_request_gets_an_error_and_the_others_their_exact_tokens():
    model = load_model("tiny", seed=0)
    prompts = token_prompts(4, 30, seed=11)
    with serve("tiny", num_gpu_blocks=64, max_model_len=128) as served:

        async def run():
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(
                    send_poison(session, served.url, stream=False),
                    send_poison(session, served.url, stream=True),
                    *(
                        complete(session, served.url, p, MAX_TOKENS, stream=i % 2 == 1)
                        for i, p in enumerate(prompts)
                    ),
                )

        (status, error), (stream_status, stream_error), *answers = asyncio.run(run())
        # The request's own settings failed it: a 400, as the gateway's ledger_failure says.
        assert status == 400 and error["code"] == 400, error
        assert error["type"] == "BadRequestError", error
        assert error["message"].startswith("the ledger failed the request"), error
        assert "the worker failed on this request" in error["message"], error
        assert "probability tensor" in error["message"], error
        assert stream_status == 200  # the stream had started; its error event names the cause
        assert "probability tensor" in stream_error["message"], stream_error
        for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            choice = answer["choices"][0]
            assert choice["token_ids"] == dense_greedy(model, prompt, MAX_TOKENS), i
            if i % 2 == 0:  # the streamed ones' helper keeps the tokens only
                assert choice["finish_reason"] == "length", i

        metrics = ledger_metrics(served.ledger_metrics_url)
        assert metric_value(metrics, "kvledger:failed_requests_total") == 2
        assert metric_value(metrics, "vllm:kv_cache_usage_perc") == 0.0
        assert metric_value(metrics, "vllm:num_requests_running") == 0
        assert metric_value(metrics, "vllm:num_requests_waiting") == 0

        async def after():  # still serving, with nothing retried
            async with aiohttp.ClientSession() as session:
                return await complete(session, served.url, prompts[0], MAX_TOKENS, stream=False)

        again = asyncio.run(after())
        assert again["choices"][0]["token_ids"] == dense_greedy(model, prompts[0], MAX_TOKENS)
