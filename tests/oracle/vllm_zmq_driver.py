"""vLLM's side of the ZMQ tests: runs *inside vLLM 0.33's venv* (KVLEDGER_VLLM_ORACLE).

One process (vLLM's import takes tens of seconds on a busy machine) serves commands, one JSON
object a line on stdin; each answer is one line on stdout starting with `@@ ` (vLLM may log on
stdout too).

- `{"cmd": "selfcheck"}`: vLLM's own ZmqEventPublisher publishes random batches while three
  `ReplaySubscriber`s read it: one from the start, one that joins late, one that misses live
  batches on purpose. Each must get exactly what was published. This checks the subscriber
  against vLLM before it is pointed at kvledger.
- `{"cmd": "subscribe", "name", "endpoint", "replay_endpoint", "topic", "skip_every"}`: start a
  subscriber (in a thread) on a kvledger ledger's ZMQ endpoints, from seq 0;
- `{"cmd": "until", "name", "last", "out"}`: wait until that subscriber has every batch up to
  `last`, write what it got to `out` (msgpack) and answer with its counts;
- `{"cmd": "publish", ...}`: vLLM's ZmqEventPublisher publishes random batches at a rate (for
  `kvledger bridge`); every payload it sent goes to `out`, then the publisher shuts down.

vLLM ships no subscriber, so `ReplaySubscriber` follows the publisher's documented protocol: a
SUB socket for live batches `(topic, seq, payload)` and a DEALER to the ROUTER replay socket,
sent the sequence to start from and answered with the kept batches from there, then seq -1.
Every batch is decoded with vLLM's own KVEventBatch decoder and must encode back to the same
bytes with vLLM's encoder.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode
ENCODE = msgspec.msgpack.Encoder().encode
CTX = zmq.Context.instance()


def answer(body: dict[str, Any]) -> None:
    sys.stdout.write("@@ " + json.dumps(body) + "\n")
    sys.stdout.flush()


class ReplaySubscriber:
    """Follows one publisher from `start`: every batch once, in order, gaps filled by replay.

    `skip(seq)`: live batches to ignore on purpose (a subscriber that misses some)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "", skip=None) -> None:
        self.sub = CTX.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.dealer = CTX.socket(zmq.DEALER)
        self.dealer.connect(replay_endpoint)
        self.topic = topic.encode()
        self.skip = skip or (lambda seq: False)
        self.next = 0
        self.accepted: list[tuple[int, bytes]] = []
        self.stash: dict[int, bytes] = {}  # live batches past a gap or during a replay
        self.replaying = False
        self.replays = 0
        self.lost: list[tuple[int, int]] = []  # ranges no replay had any more
        self.skipped = 0
        self.roundtrip_differs = 0
        self.events: dict[str, int] = {}
        self.last: int | None = None  # stop once every batch up to this one is in
        self.done = threading.Event()

    def start(self, seq: int = 0) -> None:
        self.next = seq
        self._ask(seq)

    def _ask(self, seq: int) -> None:
        self.dealer.send_multipart([b"", seq.to_bytes(8, "big")])
        self.replaying = True
        self.replays += 1

    def _take(self, seq: int, payload: bytes) -> None:
        batch = DECODE(payload)  # vLLM's decoder: raises on anything it would refuse
        if ENCODE(batch) != payload:
            self.roundtrip_differs += 1
        for event in batch.events:
            name = type(event).__name__
            self.events[name] = self.events.get(name, 0) + 1
        self.accepted.append((seq, payload))
        self.next = seq + 1

    def _live(self, frames: list[bytes]) -> None:
        topic, seq_bytes, payload = frames
        assert topic == self.topic, (topic, self.topic)
        seq = int.from_bytes(seq_bytes, "big")
        if self.skip(seq):
            self.skipped += 1
            return
        if seq < self.next:
            return  # had it from a replay
        if self.replaying or seq > self.next:
            self.stash[seq] = payload
            if not self.replaying:
                self._ask(self.next)
            return
        self._take(seq, payload)

    def _replayed(self, frames: list[bytes]) -> None:
        empty, topic, seq_bytes, payload = frames
        assert empty == b""
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == -1:
            assert topic == b"" and payload == b""
            self.replaying = False
            self._drain()
            return
        assert topic == self.topic
        if seq < self.next:
            return
        if seq > self.next:
            self.lost.append((self.next, seq - 1))
        self._take(seq, payload)

    def _drain(self) -> None:
        for seq in sorted(self.stash):
            if seq < self.next:
                del self.stash[seq]
            elif seq == self.next:
                self._take(seq, self.stash.pop(seq))
        if self.stash or (self.last is not None and self.next <= self.last):
            self._ask(self.next)  # still a gap: the batch after it came live meanwhile

    def finish_at(self, last: int) -> None:
        self.last = last

    def run(self, deadline: float) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        while time.monotonic() < deadline:
            if self.last is not None and self.next > self.last:
                break
            ready = dict(poller.poll(100))
            if self.sub in ready:
                while self.sub.poll(0):
                    self._live(self.sub.recv_multipart())
            if self.dealer in ready:
                while self.dealer.poll(0):
                    self._replayed(self.dealer.recv_multipart())
            if (
                self.last is not None
                and not self.replaying
                and self.next <= self.last
                and not ready
            ):
                self._ask(self.next)  # the tail went by before the subscription took
        self.done.set()

    def summary(self) -> dict[str, Any]:
        return {
            "accepted": len(self.accepted),
            "first": self.accepted[0][0] if self.accepted else None,
            "last": self.accepted[-1][0] if self.accepted else None,
            "replays": self.replays,
            "lost": self.lost,
            "skipped": self.skipped,
            "roundtrip_differs": self.roundtrip_differs,
            "events": self.events,
            "done": self.done.is_set(),
        }

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


# ---------------------------------------------------------------------- random batches


class RandomBatches:
    """Batches as vLLM's KV cache manager fills them: chained stores (LoRA names, extra keys with
    multimodal identifiers and cache salts, group and spec metadata), removals of what is
    stored, now and then a clear."""

    def __init__(self, seed: int, block_size: int = 16, byte_hashes: bool = False) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.byte_hashes = byte_hashes
        self.stored: list[Any] = []

    def _hash(self) -> Any:
        if self.byte_hashes:
            return self.rng.randbytes(32)
        return self.rng.getrandbits(64)

    def event(self) -> Any:
        roll = self.rng.random()
        if roll < 0.0002:
            self.stored.clear()
            return AllBlocksCleared()
        if roll < 0.35 and self.stored:
            n = min(len(self.stored), self.rng.randint(1, 4))
            removed = [self.stored.pop(self.rng.randrange(len(self.stored))) for _ in range(n)]
            return BlockRemoved(block_hashes=removed, medium="GPU", group_idx=0)
        n = self.rng.randint(1, 4)
        hashes = [self._hash() for _ in range(n)]
        lora = self.rng.choice([None, None, "sql-lora", "chat-lora"])
        extra: list[Any] | None = None
        if self.rng.random() < 0.4:
            extra = []
            for i in range(n):
                keys: list[Any] = [lora] if lora else []
                if self.rng.random() < 0.5:
                    keys.append((f"mm-{self.rng.getrandbits(32):08x}", i * self.block_size))
                if i == 0 and self.rng.random() < 0.3:
                    keys.append("tenant-salt")
                extra.append(tuple(keys) if keys else None)
        parent = self.rng.choice(self.stored) if self.stored and self.rng.random() < 0.7 else None
        self.stored.extend(hashes)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=[self.rng.randrange(32000) for _ in range(n * self.block_size)],
            block_size=self.block_size,
            lora_id=None if lora is None else (1 if lora == "sql-lora" else 2),
            medium="GPU",
            lora_name=lora,
            extra_keys=extra,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def batch(self, events: int) -> KVEventBatch:
        return KVEventBatch(ts=time.time(), events=[self.event() for _ in range(events)])


# ---------------------------------------------------------------------- commands


def selfcheck(cmd: dict[str, Any]) -> dict[str, Any]:
    """vLLM's publisher against the subscriber: from the start, late, missing batches."""
    ports = cmd["ports"]
    publisher = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{ports[0]}",
        replay_endpoint=f"tcp://*:{ports[1]}",
        buffer_steps=cmd.get("buffer_steps", 10_000),
        topic="kv@selfcheck@m",
    )
    endpoint, replay = f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"
    batches = RandomBatches(seed=cmd.get("seed", 0))
    total = cmd.get("batches", 300)
    published: list[bytes] = []
    subscribers = {
        "from_start": ReplaySubscriber(endpoint, replay, "kv@selfcheck@m"),
        "misses": ReplaySubscriber(endpoint, replay, "kv@selfcheck@m",
                                   skip=lambda seq: seq % 7 in (1, 2) or 40 <= seq < 60),
    }  # fmt: skip
    threads = []

    def follow(sub: ReplaySubscriber) -> threading.Thread:
        sub.start(0)
        thread = threading.Thread(target=sub.run, args=(time.monotonic() + 120,))
        thread.start()
        return thread

    threads += [follow(s) for s in subscribers.values()]
    for i in range(total):
        if i == total // 2:  # half-way, a late subscriber starts from 0
            subscribers["late"] = ReplaySubscriber(endpoint, replay, "kv@selfcheck@m")
            threads.append(follow(subscribers["late"]))
        batch = batches.batch(random.Random(i).randint(1, 6))
        publisher.publish(batch)
        published.append(ENCODE(batch))  # publish() set data_parallel_rank: these bytes
        time.sleep(0.002)
    for sub in subscribers.values():
        sub.finish_at(total - 1)
    for thread in threads:
        thread.join()
    publisher.shutdown()
    result = {}
    for name, sub in subscribers.items():
        result[name] = {
            **sub.summary(),
            "equal": sub.accepted == list(enumerate(published)),
        }
        sub.close()
    return result


SUBSCRIBERS: dict[str, ReplaySubscriber] = {}
THREADS: dict[str, threading.Thread] = {}


def subscribe(cmd: dict[str, Any]) -> dict[str, Any]:
    every = cmd.get("skip_every")
    skip = (lambda seq: seq % every == 1) if every else None
    sub = ReplaySubscriber(cmd["endpoint"], cmd["replay_endpoint"], cmd.get("topic", ""), skip)
    sub.start(cmd.get("start", 0))
    thread = threading.Thread(target=sub.run, args=(time.monotonic() + cmd.get("timeout", 300),))
    thread.start()
    SUBSCRIBERS[cmd["name"]], THREADS[cmd["name"]] = sub, thread
    return {"subscribed": cmd["name"]}


def until(cmd: dict[str, Any]) -> dict[str, Any]:
    sub, thread = SUBSCRIBERS.pop(cmd["name"]), THREADS.pop(cmd["name"])
    sub.finish_at(cmd["last"])
    thread.join()
    with open(cmd["out"], "wb") as f:
        f.write(msgspec.msgpack.encode(sub.accepted))
    summary = sub.summary()
    sub.close()
    return summary


def publish(cmd: dict[str, Any]) -> dict[str, Any]:
    """Random batches at `rate` events/s in batches of `batch_events` for `batches` batches,
    each written to `out` as [seq, payload] once published."""
    publisher = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=cmd["endpoint"],
        replay_endpoint=cmd["replay_endpoint"],
        buffer_steps=cmd.get("buffer_steps", 10_000),
        topic=cmd.get("topic", ""),
    )
    batches = RandomBatches(seed=cmd.get("seed", 0), byte_hashes=cmd.get("byte_hashes", False))
    per_batch, total = cmd["batch_events"], cmd["batches"]
    interval = per_batch / cmd["rate"] if cmd.get("rate") else 0.0
    time.sleep(cmd.get("delay_s", 0.0))
    built = [batches.batch(per_batch) for _ in range(total)]  # built before the clock runs
    started = time.perf_counter()
    for i, batch in enumerate(built):
        batch.ts = time.time()
        publisher.publish(batch)
        if interval:
            ahead = started + (i + 1) * interval - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
    # The publisher thread drains its queue; shutdown waits for it.
    while publisher._event_queue.qsize():
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    # Replay stays up for a late reader: `linger_s` at most, less once `linger_until` (a path)
    # exists, which the reader's side creates when it has every batch.
    deadline, done = time.monotonic() + cmd.get("linger_s", 0.0), cmd.get("linger_until")
    while time.monotonic() < deadline and not (done and os.path.exists(done)):
        time.sleep(0.05)
    publisher.shutdown()
    # publish() set each batch's data_parallel_rank: these are the bytes it sent.
    published = [(i, ENCODE(batch)) for i, batch in enumerate(built)]
    with open(cmd["out"], "wb") as f:
        f.write(msgspec.msgpack.encode(published))
    return {"batches": total, "events": total * per_batch, "seconds": elapsed,
            "events_per_s": total * per_batch / elapsed}  # fmt: skip


COMMANDS = {"selfcheck": selfcheck, "subscribe": subscribe, "until": until, "publish": publish}


def main() -> None:
    answer({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            answer(COMMANDS[cmd["cmd"]](cmd))
        except Exception as exc:  # the test shows it
            import traceback

            answer({"error": repr(exc), "trace": traceback.format_exc()})


if __name__ == "__main__":
    main()
