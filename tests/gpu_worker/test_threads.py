"""A CPU worker's torch threads: the cores it may use (affinity, capped by a cgroup v2 quota)
divided by the workers on the host, or --cpu-threads; the figure is set and logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from structlog.testing import capture_logs

from gpu_worker.threads import cgroup_cpu_quota, configure_cpu_threads, plan_threads, usable_cores

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    ("text", "cores"),
    [("200000 100000\n", 2), ("150000 100000\n", 2), ("50000 100000", 1), ("max 100000\n", None)],
)
def test_cgroup_quota_in_whole_cores(tmp_path, text, cores):
    path = tmp_path / "cpu.max"
    path.write_text(text)
    assert cgroup_cpu_quota(path) == cores


def test_no_cgroup_file_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path / "absent") is None


def test_a_quota_caps_the_affinity_mask(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path / "absent") == affinity
    quota = tmp_path / "cpu.max"
    quota.write_text("100000 100000\n")
    assert usable_cores(quota) == 1
    quota.write_text(f"{(affinity + 3) * 100000} 100000\n")
    assert usable_cores(quota) == affinity


def test_a_process_pinned_to_one_core_plans_one_thread():
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]});"
        "from gpu_worker.threads import plan_threads; p = plan_threads(None, 1);"
        "print(p.threads, p.usable_cores)"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["1", "1"], out.stderr


def test_workers_share_the_cores_and_the_flag_wins():
    cores = usable_cores()
    assert plan_threads(None, 1).threads == cores
    assert plan_threads(None, 2).threads == max(1, cores // 2)
    assert plan_threads(None, cores * 4).threads == 1  # never zero
    flagged = plan_threads(3, 2)
    assert (flagged.threads, flagged.source, flagged.workers_on_host) == (3, "flag", 2)


def test_reserved_cores_come_off_before_the_workers_share():
    cores = usable_cores()
    plan = plan_threads(None, 1, 1)
    assert (plan.threads, plan.reserved_cores) == (max(1, cores - 1), 1)
    assert plan_threads(None, 2, 1).threads == max(1, (cores - 1) // 2)
    assert plan_threads(None, 1, cores + 5).threads == 1  # never zero
    assert plan_threads(4, 1, cores).threads == 4  # the flag wins


def test_configure_sets_torch_and_logs_the_figure():
    before = torch.get_num_threads()
    try:
        with capture_logs() as logs:
            plan = configure_cpu_threads(torch.device("cpu"), None, 1)
        assert plan is not None and torch.get_num_threads() == plan.threads == usable_cores()
        (line,) = [entry for entry in logs if entry["event"] == "cpu_threads"]
        assert line["threads"] == plan.threads and line["source"] == "cores"
        assert line["usable_cores"] == usable_cores() and line["workers_on_host"] == 1
        assert line["reserved_cores"] == 0
        assert configure_cpu_threads(torch.device("cpu"), 1, 4).threads == 1  # type: ignore[union-attr]
        assert torch.get_num_threads() == 1
        assert configure_cpu_threads(torch.device("meta"), 7, 1) is None  # not a CPU worker
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("given", "policy"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_a_worker_process_logs_its_threads_and_waits_passively_unless_told(given, policy):
    """`kvledger worker` sets OMP_WAIT_POLICY before torch loads (unless the environment has
    it) and logs its thread figure at start-up, before it even reaches Redis."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "OMP_"))}
    env.update(PYTHONPATH=ROOT, KVLEDGER_LOG_FORMAT="json", KVLEDGER_WORKERS_ON_HOST="2")
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    cmd = [sys.executable, "-m", "kvledger.cli", "worker", "--model", "tiny", "--device", "cpu",
           "--redis-url", "redis://127.0.0.1:1/0", "--kv-cache-memory-bytes", "4MiB"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if '"cpu_threads"' in line:
                record = json.loads(line)
                break
        else:
            raise AssertionError("the worker exited without a cpu_threads line")
    finally:
        proc.kill()
        proc.wait()
    assert record["omp_wait_policy"] == policy and record["workers_on_host"] == 2
    assert record["threads"] == max(1, usable_cores() // 2) and record["source"] == "cores"
