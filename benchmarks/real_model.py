"""SmolLM2-135M-Instruct on this machine: kvledger's real services against transformers' generate.

    python benchmarks/real_model.py [--repeats 3] [--new-tokens 64] [--json benchmarks/results/real_model.json]

kvledger: `kvledger up --model smollm2 --device cpu` in a subprocess (private redis-server,
ledger, one worker, gateway: the real services, not an in-process runner), driven over HTTP
(/v1/completions, the prompt as token ids, greedy, ignore_eos, not streamed). Transformers: the
same GGUF file loaded by transformers (`gguf_file=`, float32), `generate(do_sample=False)` in
this process. Same dtype (float32: what 'auto' serves on the CPU), same torch threads (the
figure the worker logs in its `cpu_threads` line, set here with torch.set_num_threads), same
prompts (16 chat-templated questions), the same number of new tokens, the same OpenMP wait
policy (OMP_WAIT_POLICY: PASSIVE, the worker's default, unless the environment sets it).

  1 request:   one prompt; tokens/s = new tokens / the request's wall time.
  16 requests: kvledger gets all 16 at once; transformers generates the same 16 one after
               another (a user without a server); tokens/s = 16 x new tokens / wall time.

Repetitions are interleaved (kvledger and transformers alternate which goes first), after one
warm-up of each; the median and the range over repetitions are reported, with the load average
(the machine is shared). Targets: >= 1.0x for 1 request, >= 3x for 16. Greedy texts are also
compared: kvledger's must equal transformers' for every prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvledger.report import format_table  # noqa: E402
from services.tokenization.model_source import resolve_model  # noqa: E402
from services.transport.redis_server import free_port  # noqa: E402

MODEL_NAME = resolve_model("smollm2").name  # what the gateway serves it as

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the largest planet in the solar system?",
    "Translate 'good morning' into Spanish.",
    "What does a thermometer measure?",
    "Name a mammal that can fly.",
    "What colour is the sky on a clear day?",
    "Suggest a name for a pet goldfish.",
    "Why do we have seasons?",
]
TARGETS = {1: 1.0, 16: 3.0}


class Stack:
    """`kvledger up` serving SmolLM2 on the CPU until stopped."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "OTEL_"))}
        env.update(KVLEDGER_LOG_FORMAT="json", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "kvledger.cli", "up", "--model", "smollm2",
               "--device", "cpu", "--port", str(self.port), "--max-model-len", "1024",
               *(["--cpu-threads", str(args.threads)] if args.threads else [])]  # fmt: skip
        self.command = " ".join(["kvledger", *cmd[3:]])
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        started = time.monotonic()
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() - started > 600:
                raise RuntimeError("kvledger up did not start:\n" + "".join(self.lines[-30:]))
        self.startup_s = time.monotonic() - started
        self.url = f"http://127.0.0.1:{self.port}"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("Press Ctrl-C to stop."):
                self.ready.set()

    @property
    def threads(self) -> int:
        for line in self.lines:
            if '"cpu_threads"' in line:
                return int(json.loads(line)["threads"])
        raise RuntimeError("the worker logged no cpu_threads line")

    @property
    def capacity_line(self) -> str:
        return next((line.strip() for line in self.lines if "KV cache size:" in line[:40]), "")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


async def kvledger_run(
    url: str, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[str]]:
    """All prompts at once over HTTP; (wall seconds, texts in prompt order)."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, ids: list[int]) -> str:
        # min_tokens as transformers' min_new_tokens: the end-of-turn token masked until then
        # (ignore_eos would let it be chosen and decoding go on past it; with ignore_eos
        # vLLM's min_tokens masks only the request's stop_token_ids, so it is left off).
        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": new_tokens,
                "min_tokens": new_tokens, "temperature": 0}  # fmt: skip
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"kvledger answered {resp.status}: {data}")
            usage = data["usage"]["completion_tokens"]
            if usage != new_tokens:
                raise RuntimeError(f"kvledger generated {usage} tokens, not {new_tokens}")
            return str(data["choices"][0]["text"])

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        texts = await asyncio.gather(*(one(session, ids) for ids in prompts))
        return time.perf_counter() - started, list(texts)


def transformers_run(model: Any, tok: Any, prompts: list[list[int]], new_tokens: int):
    """The prompts one after another with generate(); (wall seconds, texts)."""
    import torch

    texts = []
    started = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.eos_token_ids[0],
            )
            texts.append(tok.decode(out[0, len(ids) :].tolist()))
    return time.perf_counter() - started, texts


def load_transformers(threads: int) -> Any:
    import torch
    import transformers

    from services.tokenization.model_source import default_model_path

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(threads)
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None,
                        help="--cpu-threads for the worker (default: its own choice), also "
                        "used for transformers")  # fmt: skip
    parser.add_argument("--sizes", default="1,16",
                        help="request counts to measure, of 1 and 16 (default: both)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/real_model.json")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    if not sizes or any(n not in TARGETS for n in sizes):
        parser.error(f"--sizes: counts among {sorted(TARGETS)}, got {args.sizes!r}")
    # The worker's OpenMP wait policy (gpu_worker/threads.py), for transformers too: set before
    # torch loads, and inherited by the stack.
    policy = os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from services.tokenization.load import load_tokenizer

    tok = load_tokenizer("smollm2")
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    load_before = os.getloadavg()
    stack = Stack(args)
    try:
        threads = stack.threads
        print(f"kvledger up started in {stack.startup_s:.0f}s; worker threads {threads}; "
              f"{stack.capacity_line}", flush=True)  # fmt: skip
        hf = load_transformers(threads)
        # Warm-up, and the greedy texts both sides must agree on.
        _, ours_texts = asyncio.run(kvledger_run(stack.url, prompts, args.new_tokens))
        transformers_run(hf, tok, prompts[:1], args.new_tokens)
        samples: dict[str, list[float]] = {f"{side}-{n}": [] for side in ("kvledger", "transformers") for n in sizes}  # fmt: skip
        hf_all: list[str] = []
        for rep in range(args.repeats):
            for n in sizes:
                batch = prompts[:n]
                sides = (
                    ["kvledger", "transformers"] if rep % 2 == 0 else ["transformers", "kvledger"]
                )
                for side in sides:
                    if side == "kvledger":
                        wall, _ = asyncio.run(kvledger_run(stack.url, batch, args.new_tokens))
                    else:
                        wall, texts = transformers_run(hf, tok, batch, args.new_tokens)
                        if n == 16 and not hf_all:
                            hf_all = texts
                    samples[f"{side}-{n}"].append(n * args.new_tokens / wall)
                    print(f"  rep {rep + 1} {side:>12} {n:>2} request(s): "
                          f"{samples[f'{side}-{n}'][-1]:6.1f} tok/s  ({wall:.1f}s)", flush=True)  # fmt: skip
    finally:
        stack.stop()
    load_after = os.getloadavg()
    if not hf_all:  # 16 not measured: the texts to compare, once
        _, hf_all = transformers_run(hf, tok, prompts, args.new_tokens)
    same = sum(a == b for a, b in zip(ours_texts, hf_all, strict=True))
    rows, summary = [], {}
    for n in sizes:
        ours, theirs = samples[f"kvledger-{n}"], samples[f"transformers-{n}"]
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        summary[n] = {"kvledger_tok_s": spread(ours), "transformers_tok_s": spread(theirs),
                      "ratio": spread(ratios), "target": TARGETS[n],
                      "met": statistics.median(ratios) >= TARGETS[n]}  # fmt: skip
        rows.append([
            f"{n} request{'s' if n > 1 else ''}",
            f"{statistics.median(ours):.1f} ({min(ours):.1f}-{max(ours):.1f})",
            f"{statistics.median(theirs):.1f} ({min(theirs):.1f}-{max(theirs):.1f})",
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
            f">= {TARGETS[n]:.1f}x: {'met' if summary[n]['met'] else 'NOT met'}",
        ])  # fmt: skip
    print()
    print(format_table(["load", "kvledger tok/s", "transformers tok/s", "ratio", "target"], rows))
    print(f"\nmedian (min-max) over {args.repeats} interleaved repetitions, {args.new_tokens} new "
          f"tokens per request, float32, {threads} torch threads each (OMP_WAIT_POLICY={policy}); "
          f"greedy texts equal for "
          f"{same}/16 prompts; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")  # fmt: skip
    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "python benchmarks/real_model.py " + " ".join(sys.argv[1:]),
        "kvledger": stack.command + " (real services: redis, ledger, worker, gateway; HTTP)",
        "transformers": "AutoModelForCausalLM.from_pretrained(gguf_file=..., dtype=float32)"
        ".generate(do_sample=False), prompts one after another",
        "threads": threads,
        "omp_wait_policy": policy,
        "cpus": len(os.sched_getaffinity(0)),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "load_average": {"before": load_before, "after": load_after},
        "greedy_texts_equal": f"{same}/16",
        "capacity_line": stack.capacity_line,
        "summary": {str(n): v for n, v in summary.items()},
        "samples_tok_s": samples,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.json.relative_to(ROOT) if args.json.is_relative_to(ROOT) else args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
