"""Poison requests over a real redis-server: a request a worker cannot sample fails alone with
an explicit error while the requests beside it get exact tokens; one that keeps failing steps
without being named is quarantined after --max-request-failures; every block is free after."""

from __future__ import annotations

import asyncio
import time

from gpu_worker.runner import ModelRunner
from services.transport import redis_streams
from services.wire import codec
from services.wire.messages import (
    GenerateRequest,
    OutputBatch,
    SamplingParams,
    StepMessage,
    StructuredOutput,
)
from tests.engine.test_ledger_service import prompts
from tests.harness.stack import Stack, dense_greedy

# A repetition penalty vLLM accepts (> 0, finite) that is 0 in float32: every prompt token
# with a positive logit is divided by it into +inf, the softmax is NaN, and torch.multinomial
# fails ("probability tensor contains either inf, nan or element < 0"). (Every token masked no
# longer fails: the sampler falls back to the raw logits for such a row.)
NOTHING_TO_SAMPLE = {"temperature": 1.0, "repetition_penalty": 1e-300}


def failed_count(stack: Stack, reason: str) -> float:
    value = stack.ledger.metrics.registry.get_sample_value(
        "kvledger:failed_requests_total", {"reason": reason}
    )
    return value or 0.0


async def test_a_request_the_worker_cannot_sample_fails_alone(redis_url, tiny_model):
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        batch = prompts(4, 20, seed=7)
        for i, prompt in enumerate(batch[:2]):
            await stack.submit(f"r{i}", prompt, 12)
        await stack.submit("poison", batch[2], 12, **NOTHING_TO_SAMPLE)
        await stack.submit("r2", batch[3], 12)
        results = await stack.wait(["r0", "r1", "r2", "poison"], timeout=120)
        poison = results["poison"].final
        assert poison.finish_reason == "error"
        assert poison.error.startswith("the worker failed on this request: RuntimeError")
        assert "probability tensor" in poison.error
        for i, prompt in enumerate([batch[0], batch[1], batch[3]]):
            assert results[f"r{i}"].final.finish_reason == "length"
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 12), f"r{i}"
        assert failed_count(stack, "worker_error") == 1
        assert stack.ledger.manager.num_free_blocks == 63
        assert not stack.ledger.manager.req_to_blocks
    finally:
        await stack.stop()


async def test_a_grammar_the_worker_cannot_build_fails_that_request_alone(redis_url, tiny_model):
    """Written straight to the requests stream (the gateway checks grammars; a producer that
    skips it must not take the step down): only that request fails, with llguidance's error."""
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        batch = prompts(3, 20, seed=12)
        bad = StructuredOutput(kind="grammar", grammar="start: undefined_rule")
        await stack.submit("r0", batch[0], 12)
        await stack.submit("bad-grammar", batch[1], 12, structured=bad)
        await stack.submit("r1", batch[2], 12)
        results = await stack.wait(["r0", "r1", "bad-grammar"], timeout=120)
        final = results["bad-grammar"].final
        assert final.finish_reason == "error"
        assert final.error.startswith("the worker failed on this request: GrammarError: ")
        assert 'unknown name: "undefined_rule"' in final.error
        assert results["bad-grammar"].tokens == []
        for i, prompt in enumerate([batch[0], batch[2]]):
            assert results[f"r{i}"].final.finish_reason == "length"
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 12), f"r{i}"
        assert failed_count(stack, "worker_error") == 1
        assert failed_count(stack, "quarantined") == 0  # no strike against the others
        await asyncio.sleep(0)
        assert stack.ledger.manager.num_free_blocks == 63
        assert not stack.ledger.manager.req_to_blocks
        assert stack.ledger.quarantine.strikes == {}
    finally:
        await stack.stop()


async def test_a_tiny_temperature_from_a_gateway_that_does_not_exist_samples_at_vllms_floor(
    redis_url, tiny_model
):
    """Written straight to the requests stream: a positive temperature of 1e-300 would overflow
    the logits; the ledger raises it to vLLM's floor of 0.01 (SamplingParams.__post_init__), so
    it samples (seeded: the same twice) without poisoning the step of the request beside it."""
    stack = await Stack(redis_url, tiny_model, num_blocks=64).start()
    try:
        prompt = prompts(1, 12, seed=8)[0]
        for name in ("tiny-temp-a", "tiny-temp-b"):
            msg = GenerateRequest(
                req_id=name, gateway_id="no-such-gateway", prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=4, temperature=1e-300, seed=7),
                arrival_time=time.time(),
            )  # fmt: skip
            await redis_streams.append(stack.r, stack.streams.requests, msg)
        await stack.submit("after", prompt, 4)
        await stack.wait(["after"], timeout=60)
        deadline = time.monotonic() + 30
        while True:
            entries = await stack.r.xrange(stack.streams.outputs("no-such-gateway"))
            outs = [
                o
                for _, f in entries
                for o in codec.decode(f[redis_streams.FIELD], OutputBatch).outputs
            ]
            if sum(o.finished for o in outs) == 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        tokens = {
            name: [t for o in outs if o.req_id == name for t in o.new_token_ids]
            for name in ("tiny-temp-a", "tiny-temp-b")
        }
        assert len(tokens["tiny-temp-a"]) == 4 and tokens["tiny-temp-a"] == tokens["tiny-temp-b"]
        assert all(0 <= t < tiny_model.config.vocab_size for t in tokens["tiny-temp-a"])
        assert {o.finish_reason for o in outs if o.finished} == {"length"}
        assert stack.results["after"].tokens == dense_greedy(tiny_model, prompt, 4)
        assert stack.ledger.scheduler.num_preemptions == 0
    finally:
        await stack.stop()


class FailsWithPoison(ModelRunner):
    """Fault injection: every step that holds the request 'poison' fails as a whole, and the
    worker cannot tell which request caused it."""

    def run_step(self, step: StepMessage):
        if "poison" in step.num_scheduled_tokens:
            raise RuntimeError("injected fault")
        return super().run_step(step)


async def test_a_request_that_keeps_failing_steps_is_quarantined(redis_url, tiny_model):
    stack = Stack(redis_url, tiny_model, num_blocks=64, max_request_failures=3)
    stack.runner_factory = FailsWithPoison
    await stack.start()
    try:
        batch = prompts(3, 20, seed=9)
        await stack.submit("poison", batch[0], 8)
        results = await stack.wait(["poison"], timeout=60)
        final = results["poison"].final
        assert final.finish_reason == "error"
        assert final.error.startswith("quarantined: 3 steps with this request failed")
        assert "injected fault" in final.error
        assert failed_count(stack, "quarantined") == 1
        # The service goes on: later requests get exact tokens, every block is free.
        for i, prompt in enumerate(batch[1:]):
            await stack.submit(f"r{i}", prompt, 8)
        results = await stack.wait(["r0", "r1"], timeout=60)
        for i, prompt in enumerate(batch[1:]):
            assert results[f"r{i}"].tokens == dense_greedy(tiny_model, prompt, 8)
        await asyncio.sleep(0)
        assert stack.ledger.manager.num_free_blocks == 63
        assert stack.ledger.quarantine.strikes == {}
    finally:
        await stack.stop()
