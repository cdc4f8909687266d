"""Issue 3 end to end through HTTP: `kvledger up`'s real processes serve concurrent completions,
streaming and not; a repeated prompt hits the prefix cache and gives the same greedy text, which
is the dense (cache-free) model's text."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gpu_worker.checkpoint import load_model
from services.tokenization.tokenizer import ByteTokenizer
from tests.e2e.conftest import metric_value, serve
from tests.e2e.test_traces import complete, token_prompts
from tests.harness.stack import dense_greedy


@pytest.fixture(scope="module")
def served():
    with serve("tiny", num_gpu_blocks=40, max_model_len=256) as s:
        yield s


async def _text_completion(session, url: str, prompt: str, stream: bool) -> dict:
    body = {
        "model": "kvledger-tiny-llama",
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "stream": stream,
    }
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        if not stream:
            return await resp.json()
        text, finish = "", None
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    text += choice["text"]
                    finish = choice.get("finish_reason") or finish
        return {"choices": [{"text": text, "finish_reason": finish}]}


def test_concurrent_completions_streaming_and_not_match_the_dense_model(served):
    model = load_model("tiny", seed=0)
    prompts = token_prompts(6, 45, seed=7)

    async def run():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(
                *(
                    complete(session, served.url, p, 20, stream=i % 2 == 1)
                    for i, p in enumerate(prompts)
                )
            )

    responses = asyncio.run(run())
    for prompt, response in zip(prompts, responses, strict=True):
        assert response["choices"][0]["token_ids"] == dense_greedy(model, prompt, 20)
        assert response["usage"]["completion_tokens"] == 20


def test_a_repeated_prompt_hits_the_prefix_cache_and_gives_the_same_text(served):
    prompt = "The ledger keeps the books of every KV block; the workers only hold the tensors. " * 2
    tokenizer = ByteTokenizer()

    async def run():
        async with aiohttp.ClientSession() as session:
            first = await _text_completion(session, served.url, prompt, stream=False)
            second = await _text_completion(session, served.url, prompt, stream=False)
            streamed = await _text_completion(session, served.url, prompt, stream=True)
            return first, second, streamed

    first, second, streamed = asyncio.run(run())
    num_prompt = len(tokenizer.encode(prompt))
    assert first["usage"]["prompt_tokens"] == num_prompt
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Every full block but the one holding the last prompt token is reused.
    assert (
        second["usage"]["prompt_tokens_details"]["cached_tokens"] == (num_prompt - 1) // 16 * 16 > 0
    )
    assert (
        second["choices"][0]["text"]
        == first["choices"][0]["text"]
        == streamed["choices"][0]["text"]
    )
    model = load_model("tiny", seed=0)
    expected = tokenizer.decode(dense_greedy(model, tokenizer.encode(prompt), 12))
    assert first["choices"][0]["text"] == expected


def test_chat_models_health_and_metrics(served):
    async def run():
        async with aiohttp.ClientSession() as session:
            chat = await (
                await session.post(
                    f"{served.url}/v1/chat/completions",
                    json={
                        "model": "kvledger-tiny-llama",
                        "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 5,
                    },
                )
            ).json()
            models = await (await session.get(f"{served.url}/v1/models")).json()
            health = await session.get(f"{served.url}/health")
            text = await (await session.get(served.ledger_metrics_url)).text()
            return chat, models, health.status, await health.json(), text

    chat, models, health, health_body, text = asyncio.run(run())
    assert (
        chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    )
    assert chat["usage"]["completion_tokens"] == 5
    assert [m["id"] for m in models["data"]] == ["kvledger-tiny-llama"]
    assert health == 200
    # The worker chose its attention backend at start-up and every surface reports it.
    backends = health_body["ledger"]["attention_backends"]
    assert list(backends.values()) == ["torch-reference"]
    worker_id = next(iter(backends))
    info = f'kvledger:worker_info{{attention_backend="torch-reference",device="cpu",worker_id="{worker_id}"}} 1.0'
    assert info in text
    assert metric_value(text, "vllm:prefix_cache_queries_total") > 0
    assert "Maximum concurrency for 256 tokens per request" in served.capacity_line


def test_up_refuses_to_start_when_one_max_model_len_request_cannot_fit():
    import subprocess
    import sys

    from services.transport.redis_server import free_port
    from tests.e2e.conftest import ROOT, _hermetic_env

    done = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "up", "--model", "tiny", "--port", str(free_port()),
         "--device", "cpu", "--num-gpu-blocks-override", "10", "--max-model-len", "2048"],
        cwd=ROOT, env=_hermetic_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1
    assert "To serve at least one request with the model's max seq len (2048)" in output
    assert "the estimated maximum model length is 144" in output  # 9 usable blocks of 16
    assert "the ledger exited at start-up with code 3" in output


def test_up_refuses_cuda_kernels_on_the_cpu_with_what_to_change():
    import subprocess
    import sys

    from services.transport.redis_server import free_port
    from tests.e2e.conftest import ROOT, _hermetic_env

    done = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "up", "--model", "tiny", "--port", str(free_port()),
         "--device", "cpu", "--kernels", "cuda"],
        cwd=ROOT, env=_hermetic_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1
    assert "the CUDA kernels need a CUDA device, and this worker runs on cpu" in output
    assert "the worker exited at start-up with code 3" in output
