"""docs/operations.md's Redis sizing table, held to what Redis uses: every stream filled to its
cap (the caps of services/transport/keys.py, the writers' own trimming: approximate MAXLEN, the
KV-events stream's memory budget through the ledger's publisher, dead letters through
`redis_streams.dead_letter`) with entries of the table's measured payload size, on a private
redis-server; then each stream's MEMORY USAGE and the server's INFO memory against the table.

It writes over a gigabyte: `-m redis_sizing` runs it (deselected otherwise, like `faults`).
The table's sizes come from `python benchmarks/redis_sizing.py`.
"""

from __future__ import annotations

import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.event_stream import KVEventStream
from ledger.block_pool import BlockPool
from ledger.events import BlockStored
from services.transport import keys, redis_streams
from services.transport.keys import StreamNames
from services.transport.redis_server import RedisServer

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
TOLERANCE = 0.15  # Redis' allocator rounds, approximate trimming keeps up to a node more
ROW = re.compile(
    r"^\| `(?P<key>[^`]+)`[^|]*\| (?P<cap>[^|]+) \| (?P<payload>[\d,]+) B[^|]* \| "
    r"(?P<per_entry>[\d,]+) B \| (?P<at_cap>[\d,]+) MB \|$"
)
TOTAL = re.compile(r"^\| \*\*total\*\*[^|]*\|.*\| \*\*(?P<mb>[\d,]+) MB\*\* \|$")
CAPS = {
    "requests": keys.REQUESTS_MAXLEN,
    "outputs:<gateway>": keys.OUTPUTS_MAXLEN,
    "steps:<group>": keys.STEPS_MAXLEN,
    "results": keys.RESULTS_MAXLEN,
    "dead-letters": keys.DEAD_LETTERS_MAXLEN,
}


@dataclass
class Row:
    key: str
    cap: str
    payload: int
    per_entry: int
    at_cap_mb: int


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def sizing_table() -> tuple[dict[str, Row], int]:
    section = DOC.read_text().split("### Redis sizing", 1)[1].split("\n## ", 1)[0]
    rows, total = {}, None
    for line in section.splitlines():
        if found := ROW.match(line.strip()):
            rows[found["key"]] = Row(
                found["key"], found["cap"].strip(), _number(found["payload"]),
                _number(found["per_entry"]), _number(found["at_cap"]),
            )  # fmt: skip
        elif found := TOTAL.match(line.strip()):
            total = _number(found["mb"])
    assert total is not None, "the sizing table has no total row"
    return rows, total


def test_the_table_uses_the_codes_caps_and_adds_up():
    # The short version, in every run: the table's caps are the code's and its sums add up.
    rows, total = sizing_table()
    assert set(rows) == {*CAPS, "kv-events"}, sorted(rows)
    for key, cap in CAPS.items():
        assert _number(rows[key].cap.split()[0]) == cap, (key, rows[key].cap, cap)
        assert abs(rows[key].at_cap_mb - cap * rows[key].per_entry / 1e6) <= 1, rows[key]
    assert rows["kv-events"].cap.startswith("256 MB")  # --kv-events-max-mb's default
    assert rows["kv-events"].at_cap_mb == 256
    assert total == sum(row.at_cap_mb for row in rows.values())


def _stored_batch(rng: random.Random, payload: int) -> list[BlockStored]:
    """KV events whose batch is about `payload` bytes (one stored block is ~60 + 3/token)."""
    blocks = max(1, payload // 110)
    return [
        BlockStored(
            block_hashes=[rng.getrandbits(63) for _ in range(blocks)],
            parent_block_hash=rng.getrandbits(63),
            token_ids=[rng.randrange(128_256) for _ in range(16 * blocks // 4)],
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    ]


async def _fill(r, stream: str, payload: bytes, cap: int) -> None:
    """Past the cap (10% more), as the writers do: XADD with MAXLEN ~ cap."""
    for _start in range(0, cap + cap // 10, 1000):
        async with r.pipeline(transaction=False) as pipe:
            for _ in range(1000):
                pipe.xadd(stream, {redis_streams.FIELD: payload}, maxlen=cap, approximate=True)
            await pipe.execute()


async def _used_memory(r) -> int:
    return int((await r.info("memory"))["used_memory"])


@pytest.mark.slow
@pytest.mark.redis_sizing
@pytest.mark.timeout(3600)
async def test_every_stream_filled_to_its_cap_takes_what_the_table_says():
    rows, total_mb = sizing_table()
    streams = StreamNames("sizing", "default")
    names = {
        "requests": streams.requests,
        "outputs:<gateway>": streams.outputs("gateway-0"),
        "steps:<group>": streams.steps("default"),
        "results": streams.results,
    }
    with RedisServer() as server:
        r = redis_streams.connect(server.url)
        try:
            before = await _used_memory(r)
            used = {}
            started = time.monotonic()
            for key, stream in names.items():
                value = os.urandom(rows[key].payload - len(redis_streams.FIELD))
                await _fill(r, stream, value, CAPS[key])
                used[key] = await r.memory_usage(stream, samples=0)
                print(f"{key}: {used[key] / 1e6:.0f} MB at {time.monotonic() - started:.0f}s")
            # Dead letters through the real path: the widest entry a dead letter keeps (16
            # fields, each cut to its first KiB), as the table assumes.
            wide = {f"f{i:02d}".encode(): os.urandom(4096) for i in range(16)}
            entry = redis_streams.Entry(streams.requests, b"0-1", wide)
            for _ in range(CAPS["dead-letters"] + CAPS["dead-letters"] // 10):
                await redis_streams.dead_letter(r, streams.dead_letters, entry, "not msgpack")
            used["dead-letters"] = await r.memory_usage(streams.dead_letters, samples=0)
            # The KV events through the ledger's publisher and its memory budget.
            budget = rows["kv-events"].at_cap_mb * 1_000_000
            events = KVEventStream(
                r, streams, max_bytes=budget, snapshot_interval_s=1e9, block_size=16,
                hash_algo="sha256",
            )  # fmt: skip
            pool, rng = BlockPool(8, enable_caching=True), random.Random(0)
            batches = [_stored_batch(rng, rows["kv-events"].payload) for _ in range(64)]
            while events._entry_bytes < 1.2 * budget:
                await events.publish(batches[events.batches % len(batches)], pool, "e.1")
            used["kv-events"] = await r.memory_usage(streams.events, samples=0)
            after = await _used_memory(r)
        finally:
            await r.aclose()
    report = {key: (round(used[key] / 1e6), rows[key].at_cap_mb) for key in used}
    print(f"MB used at the cap vs the table: {report}; INFO used_memory grew "
          f"{(after - before) / 1e6:.0f} MB, the table's total is {total_mb} MB")  # fmt: skip
    for key, (measured, documented) in report.items():
        assert abs(measured - documented) <= TOLERANCE * documented + 1, (key, report)
    assert abs((after - before) / 1e6 - total_mb) <= TOLERANCE * total_mb, report
