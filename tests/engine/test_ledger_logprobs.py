"""Logprobs through the ledger and worker services: each output token carries its entry, the
prompt's come with the first token, and a request that asks for prompt logprobs reads nothing
from the prefix cache (its blocks are still cached for the next request)."""

from __future__ import annotations

import torch

from tests.harness.stack import Stack, dense_greedy

PROMPT = list(range(40, 80))  # 40 tokens: two full blocks of 16 are cacheable


async def test_logprobs_and_prompt_logprobs_reach_the_gateway_and_skip_the_prefix_cache(
    redis_url, tiny_model
):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        await stack.submit("warm", PROMPT, 4)
        await stack.wait(["warm"])
        await stack.submit("asks", PROMPT, 6, logprobs=2, prompt_logprobs=1)
        asks = (await stack.wait(["asks"]))["asks"]
        await stack.submit("after", PROMPT, 2)
        after = (await stack.wait(["after"]))["after"]
    finally:
        await stack.stop()
    assert stack.results["warm"].logprobs == [] and stack.results["warm"].prompt_logprobs is None
    assert asks.final.num_cached_tokens == 0  # skipped the two cached blocks
    assert after.final.num_cached_tokens == 32
    assert asks.tokens == dense_greedy(tiny_model, PROMPT, 6)
    with torch.inference_mode():
        expected = tiny_model.dense_logits(PROMPT + asks.tokens).float().log_softmax(-1)
    assert [e.token_ids[0] for e in asks.logprobs] == asks.tokens
    for i, entry in enumerate(asks.logprobs):
        assert len(entry.token_ids) == 3
        assert abs(entry.logprobs[0] - expected[len(PROMPT) - 1 + i, asks.tokens[i]].item()) < 1e-4
    assert asks.prompt_logprobs is not None and len(asks.prompt_logprobs) == len(PROMPT) - 1
    for position, entry in enumerate(asks.prompt_logprobs, start=1):
        assert entry.token_ids[0] == PROMPT[position] and len(entry.token_ids) == 2
        assert abs(entry.logprobs[0] - expected[position - 1, PROMPT[position]].item()) < 1e-4
