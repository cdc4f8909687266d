"""Which decode steps the worker replays from CUDA graphs (kernels/graphs.py), on the CPU; the
replays themselves are GPU tests (test_kernel_gpu.py)."""

from __future__ import annotations

from kernels.graphs import BUCKETS, graph_bucket


def test_decode_steps_take_the_smallest_cuda_graph_bucket_and_the_rest_run_eagerly():
    assert [graph_bucket(n, n, 1, 10, 64) for n in (1, 3, 8, 9, 200, 256)] == [
        1, 4, 8, 16, 256, 256,
    ]  # fmt: skip
    assert graph_bucket(257, 257, 1, 10, 64) is None  # past the largest bucket
    assert graph_bucket(4, 7, 4, 10, 64) is None  # an extend or a prefill in the step
    assert graph_bucket(4, 4, 1, 65, 64) is None  # a block table wider than the graphs'
    assert graph_bucket(0, 0, 0, 1, 64) is None
    assert list(BUCKETS) == sorted(BUCKETS)
