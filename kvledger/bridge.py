"""`kvledger bridge`: a vLLM server's KV events (its ZMQ publisher) on a replica's Redis stream,
written exactly as a kvledger ledger writes its own, so `kvledger indexer`, `kvledger events`,
the subscriber in `services/events/subscriber.py` and the gateway's event follower treat the
vLLM server as a replica.

It follows the server's PUB socket and replay socket (`services/events/zmq_follower.py`: gaps
filled by replay, a restarted publisher told apart from one that is ahead), and for each batch
appends one stream entry: `batch`, vLLM's bytes unchanged; `hashes`, the runs an index applies
(block hashes as unsigned 64-bit ints, vLLM's byte hashes converted as vLLM converts them);
`seq`, the stream's own sequence (it goes on across bridge restarts and publisher restarts);
`source_seq`, the publisher's sequence of the batch. It keeps the mirror of cached blocks and
writes the snapshot as a ledger does, and a status key (block size, hash algorithm, model) that
routers read as a ledger's.

- A restarted publisher (its sequence back to 0, or the batch at the last sequence applied not
  the one applied) or batches lost for good (no longer in its replay buffer) start a new epoch:
  an AllBlocksCleared entry, then the publisher's batches from the oldest it keeps. An
  AllBlocksCleared the publisher sends itself is forwarded like any batch.
- A restarted bridge resumes: it takes the last `source_seq` and batch from the stream, rebuilds
  its mirror from the snapshot and the entries after it, and asks the publisher's replay socket
  for what it missed, checking that the batch at that sequence is the one it applied.
- One writer per replica: the bridge holds the replica's lease (as a ledger does) and its
  appends are fenced by the lease token.
- Routers hash prompts with the block size, hash algorithm and seed (PYTHONHASHSEED) the bridge
  is given, and so does the bridge to check them: the first BlockStored events that start a
  prompt (no parent, no LoRA or extra keys) are hashed from their `token_ids` and compared with
  the hashes the server sent. When they disagree the replica is out (its status says so, with
  no worker) and a log line says why; the events are still forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import uuid
from typing import cast

import redis.asyncio as aioredis

from engine.event_stream import KVEventStream
from engine.leadership import Leadership
from ledger.events import (
    AllBlocksCleared,
    BlockStored,
    EventDecodeError,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from ledger.hashing import BlockHasher, to_event_hash
from observability import get_logger
from services.config import BridgeConfig
from services.environment import ConfigError
from services.events.runs import HASHES_FIELD, TIERS_FIELD, decode_runs, decode_tier_runs
from services.events.snapshot import (
    CLEARED,
    decode_snapshot,
    snapshot_counts,
    snapshot_tier_counts,
)
from services.events.subscriber import PrefixIndex, batch_runs_by_tier, event_hash
from services.events.zmq_follower import Batch, ZmqFollower
from services.startup import freeze_after_startup
from services.transport import redis_streams
from services.wire.codec import encode
from services.wire.messages import LedgerStatus

log = get_logger("kvledger.bridge")

SOURCE_SEQ_FIELD = b"source_seq"
STATUS_INTERVAL_S = 1.0
MAX_GROUP = 256  # batches appended in one write at most
HASH_CHECKS = 8  # BlockStored events checked against the hash settings before trusting them
# Batches decoded whole for that check at most: a server whose events never start a plain
# prompt (LoRA, salts, media everywhere) does not pay the full decode on every batch forever.
HASH_CHECK_BATCHES = 256
GC_YOUNG = 50_000  # allocations between two collections of the youngest generation


async def serve(config: BridgeConfig) -> None:
    """Run the bridge until cancelled (`kvledger bridge`)."""
    if not config.endpoint:
        raise ConfigError("--endpoint: the vLLM server's KV-events endpoint is required")
    assert config.redis_url, "the caller checks that there is a Redis to talk to"
    # The youngest generation is collected every GC_YOUNG allocations instead of 700: a
    # 100-event batch leaves ~100 lists and tuples (its runs) alive until its group is written,
    # so with the default a collection ran every ~9 batches (and, before start-up's objects
    # were frozen, a full one every ~1,000): ~20 us of a batch's ~200 us of CPU.
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
    r = redis_streams.connect(config.redis_url)
    try:
        await Bridge(config, r).run()
    finally:
        await r.aclose()


class Bridge:
    def __init__(self, config: BridgeConfig, r: aioredis.Redis) -> None:
        assert config.endpoint is not None
        self.cfg = config
        self.r = r
        self.streams = config.streams
        self.leadership = Leadership(r, self.streams, config.leader_ttl_s)
        self.events = KVEventStream(
            r, self.streams, max_bytes=int(config.kv_events_max_mb * 1e6),
            snapshot_interval_s=config.snapshot_interval_s, block_size=config.block_size,
            hash_algo=config.hash_algo, writer=self.leadership,
        )  # fmt: skip
        self.follower = ZmqFollower(config.endpoint, config.replay_endpoint, config.topic)
        self.bridge_id = uuid.uuid4().hex[:12]
        self.generation = 0
        self.started_at = time.time()
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()  # set once following
        self.forwarded = 0  # batches appended
        self._appending: asyncio.Task[None] | None = None  # the append in flight
        self._appending_count = 0  # its batches
        self.undecodable = 0
        self.resets: list[str] = []
        self.resumed_at: int | None = None  # the publisher's sequence resumed after
        self.hasher = BlockHasher(config.hash_algo)  # the seed: PYTHONHASHSEED, as vLLM's
        self.hash_checks = 0  # BlockStored events found hashed as the settings say
        self.hash_batches = 0  # batches decoded whole for that check
        self.hash_mismatch: str | None = None  # why they are not (the replica is out)

    @property
    def epoch(self) -> str:
        return f"bridge-{self.bridge_id}.{self.generation}"

    async def run(self) -> None:
        await self.leadership.acquire(self.stopping)
        lease = asyncio.create_task(self.leadership.renew_forever(), name="lease")
        status = asyncio.create_task(self._status_forever(), name="status")
        try:
            startup = redis_streams.Reconnect("startup", lambda loop: None)
            resume = await startup.call(self._resume)
            self.resumed_at = None if resume is None else resume[0]
            self.follower.open(resume)
            if resume is None:
                await self._new_epoch("bridge start")
            # What start-up left (modules, the resumed mirror) is walked by no collection from
            # here on (`serve` also makes the young collections rarer).
            log.info("gc_frozen", objects=freeze_after_startup())
            log.info(
                "bridge_following", endpoint=self.cfg.endpoint,
                replay_endpoint=self.cfg.replay_endpoint, topic=self.cfg.topic,
                replica=self.streams.replica, resumed_after=self.resumed_at,
            )  # fmt: skip
            self.ready.set()
            while not self.stopping.is_set():
                if lease.done():
                    lease.result()  # the lease went to another writer: stop loudly
                if self._appending is not None and self._appending.done():
                    await self._appended()  # its error, if any, stops the bridge here
                group: list[Batch] = []
                for item in await self.follower.poll(0.25):
                    if isinstance(item, Batch):
                        group.append(item)
                        if len(group) >= MAX_GROUP:
                            await self._forward(group)
                            group = []
                        continue
                    await self._forward(group)
                    await self._appended()
                    group = []
                    log.warning("bridge_reset", reason=item.reason, replica=self.streams.replica)
                    self.resets.append(item.reason)
                    await self._new_epoch(item.reason)
                await self._forward(group)
        finally:
            for task in (lease, status):
                task.cancel()
            await asyncio.gather(lease, status, return_exceptions=True)
            self.follower.close()
            if self._appending is not None:  # the mirror is as of what it wrote, or not
                with contextlib.suppress(Exception):
                    await self._appended()
            if self.leadership.held():
                try:
                    await self.events.write_snapshot(None, self.epoch)
                    await self.r.delete(self.streams.ledger_status)
                finally:
                    await self.leadership.release()

    async def _forward(self, batches: list[Batch]) -> None:
        """Append these batches, in order, in one write, left in flight: the bridge reads and
        decodes the next ones while Redis appends these (one append in flight at a time, so
        they land in order)."""
        entries = []
        for batch in batches:
            try:
                runs, tier_runs = batch_runs_by_tier(batch.payload)
            except EventDecodeError as exc:
                # Stepped over, never guessed at: the index misses this batch's effect.
                self.undecodable += 1
                log.error("bridge_batch_undecodable", seq=batch.seq, error=str(exc))
                continue
            if (
                self.hash_checks < HASH_CHECKS
                and self.hash_batches < HASH_CHECK_BATCHES
                and self.hash_mismatch is None
            ):
                self.hash_batches += 1
                self._check_hashes(batch.payload)
            entries.append((batch.payload, runs, {SOURCE_SEQ_FIELD: b"%d" % batch.seq}, tier_runs))
        if not entries:
            return
        await self._appended()
        self._appending = asyncio.create_task(self.events.append_many(entries, self.epoch))
        self._appending_count = len(entries)

    async def _appended(self) -> None:
        """Wait for the append in flight, if any (raising what it raised)."""
        appending, self._appending = self._appending, None
        if appending is not None:
            await appending
            self.forwarded += self._appending_count

    def _check_hashes(self, payload: bytes) -> None:
        """Hash the batch's prompt-starting BlockStored events as routers will; a disagreement
        takes the replica out (`status`)."""
        problem = None
        for event in decode_batch(payload).events:
            if problem is not None or self.hash_checks >= HASH_CHECKS:
                break
            if not isinstance(event, BlockStored) or event.parent_block_hash is not None:
                continue  # its parent's full digest is not in the event: nothing to chain from
            if event.lora_name is not None or any(event.extra_keys or ()):
                continue  # LoRA, a cache salt or media: not what a plain prompt hashes
            problem = hash_settings_problem(event, self.hasher, self.cfg.block_size)
            self.hash_checks += 1
        if problem is None:
            return
        self.hash_mismatch = (
            f"the server's KV events do not hash as this bridge was told ({problem}); routers "
            f"hashing prompts with --block-size {self.cfg.block_size}, --prefix-caching-hash-"
            f"algo {self.cfg.hash_algo} and this PYTHONHASHSEED would never find its blocks. "
            "Give the bridge and the gateway the server's settings"
        )
        log.error("bridge_hash_mismatch", replica=self.streams.replica, reason=self.hash_mismatch)

    async def _new_epoch(self, reason: str) -> None:
        """The view of the replica starts over: AllBlocksCleared, then a fresh snapshot."""
        self.generation += 1
        clear = encode_batch(KVEventBatch(time.time(), [AllBlocksCleared()]))
        await self.events.append(clear, [(CLEARED, [])], self.epoch)
        await self.events.write_snapshot(None, self.epoch)
        log.info("epoch_started", epoch=self.epoch, reason=reason)

    async def _resume(self) -> tuple[int, bytes] | None:
        """(the publisher's sequence, payload) of the last batch forwarded, with the mirror
        rebuilt as of the stream's last entry; None when there is nothing to resume from (a
        first start, or a stream the snapshot no longer lines up with)."""
        await self.events.resume(0)
        last = None
        for _, fields in cast(
            list[tuple[bytes, dict[bytes, bytes]]],
            await self.r.xrevrange(self.streams.events, count=1000),
        ):
            if SOURCE_SEQ_FIELD in fields and b"batch" in fields:
                last = (int(fields[SOURCE_SEQ_FIELD]), fields[b"batch"])
                break
        if last is None:
            return None
        data = await self.r.get(self.streams.events_snapshot)
        if data is None:
            return None
        snapshot = decode_snapshot(cast(bytes, data))
        index = PrefixIndex()  # the GPU's blocks and the tiers', as a subscriber builds them
        index.counts, index.tiers = snapshot_counts(snapshot), snapshot_tier_counts(snapshot)
        last_id = snapshot.stream_id.encode()
        if snapshot.stream_id != "0-0" and not await self.r.xrange(
            self.streams.events, min=last_id, max=last_id
        ):
            return None  # trimmed past the snapshot: the mirror cannot be rebuilt
        start = b"(" + last_id
        while True:
            entries = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                await self.r.xrange(self.streams.events, min=start, count=1000),
            )
            for entry_id, fields in entries:
                if HASHES_FIELD in fields:
                    index.apply_runs(decode_runs(fields[HASHES_FIELD]))
                    if TIERS_FIELD in fields:
                        index.apply_tier_runs(decode_tier_runs(fields[TIERS_FIELD]))
                else:
                    runs, tier_runs = batch_runs_by_tier(fields[b"batch"])
                    index.apply_runs(runs)
                    index.apply_tier_runs(tier_runs)
                last_id = entry_id
            if len(entries) < 1000:
                break
            start = b"(" + entries[-1][0]
        self.events.load(index.counts, last_id, index.tiers)
        # The epoch goes on: a resumed bridge is no new view of the replica.
        bridge_id, _, generation = snapshot.epoch.removeprefix("bridge-").rpartition(".")
        if bridge_id and generation.isdigit():
            self.bridge_id, self.generation = bridge_id, int(generation)
        return last

    async def _status_forever(self) -> None:
        """The status key routers read as a ledger's: block size, hash algorithm, model."""
        while True:
            try:
                if self.leadership.held():
                    await self.r.set(self.streams.ledger_status, encode(self.status()), px=5000)
            except aioredis.RedisError as exc:
                log.warning("bridge_status_failed", error=str(exc))
            await asyncio.sleep(STATUS_INTERVAL_S)

    def status(self) -> LedgerStatus:
        cfg = self.cfg
        return LedgerStatus(
            epoch=self.epoch,
            started_at=self.started_at,
            updated_at=time.time(),
            model_name=cfg.served_model_name,
            max_model_len=cfg.max_model_len,
            vocab_size=0,
            block_size=cfg.block_size,
            num_gpu_blocks=0,
            capacity_line=(
                f"out: {self.hash_mismatch}"
                if self.hash_mismatch
                else f"vLLM server's KV events from {cfg.endpoint} (kvledger bridge)"
            ),
            hash_algo=cfg.hash_algo,
            # No worker: routers send nothing (and the capacity line says why).
            num_workers=0 if self.hash_mismatch else 1,
        )


def hash_settings_problem(event: BlockStored, hasher: BlockHasher, block_size: int) -> str | None:
    """Why a BlockStored event that starts a prompt is not hashed with `hasher` and
    `block_size` (None: it is)."""
    if event.block_size != block_size:
        return f"its blocks are {event.block_size} tokens, not {block_size}"
    want = [to_event_hash(h) for h in hasher.hash_blocks(event.token_ids, block_size)]
    got = [event_hash(h) for h in event.block_hashes]
    if len(want) < len(got):
        return f"{len(got)} blocks stored with only {len(event.token_ids)} token_ids"
    for index, (mine, theirs) in enumerate(zip(want, got, strict=False)):
        if mine != theirs:
            return (
                f"block {index} of a prompt is stored as {theirs:#018x}; {hasher.algo} of its "
                f"token_ids gives {mine:#018x}"
            )
    return None
