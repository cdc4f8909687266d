"""KV events over ZMQ, as vLLM 0.33 publishes them, beside the Redis stream.

Routers written for vLLM (llm-d's KV-cache indexer, Dynamo's router, vLLM's own examples)
subscribe to a PUB socket and ask a ROUTER socket for what they missed. This publisher speaks
that protocol with the bytes the ledger already puts on its Redis stream:

- PUB: one message per batch, three frames: the topic, the batch's sequence number as 8 bytes
  big-endian, the msgpack batch (the stream entry's `batch` field, unchanged).
- ROUTER (replay): a client (DEALER, or REQ for one answer) sends the sequence to start from,
  8 bytes big-endian; it gets `[b"", topic, seq, batch]` for every kept batch from there on,
  then `[b"", b"", -1 as 8 signed bytes, b""]`. The last `buffer_steps` batches are kept.

The sequence is the stream's (`KVEventStream.seq`): it continues across ledger restarts and
failovers, and a standby that takes over keeps the stream's last `buffer_steps` batches for
replay, so to a subscriber a failover looks like a pause, not a publisher restart.

The engine loop only appends to a bounded queue (`publish`, never blocking); a thread owns the
sockets, sends, keeps the replay buffer and answers replay requests. When the queue is full the
batch is dropped and counted (a subscriber then sees a gap no replay fills, and resyncs from the
snapshot). Before sending each batch the thread asks the lease: while it may have lapsed the
thread waits for the engine to renew it; once another ledger holds it nothing more goes out and
the sockets are closed, so a successor on this host can bind them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

import zmq

from observability import get_logger
from services.config import KVEventsConfig

log = get_logger("kvledger.ledger")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_STOP = object()
# How long `close` lets the thread send what is queued before it closes the sockets.
CLOSE_TIMEOUT_S = 1.0
BIND_RETRY_S = 0.2


class Fence(Protocol):
    """What the publisher asks before each batch (engine.leadership.Leadership is one)."""

    def held(self) -> bool: ...

    @property
    def lost(self) -> bool: ...


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address, ipc or inproc is bound; any other is connected to (a
    PUB that connects to a proxy's XSUB)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """One replica's ZMQ publisher: `start`, then `publish(seq, batch)` from the engine loop,
    `close` at the end."""

    def __init__(
        self,
        config: KVEventsConfig,
        *,
        fence: Fence | None = None,
        on_drop: Callable[[int], None] | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.config = config
        self.fence = fence
        self.on_drop = on_drop
        self.ctx = context or zmq.Context.instance()
        self.topic = config.topic.encode()
        self.max_queue = config.max_queue_size
        self.queue: deque = deque()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.endpoint: str | None = None  # as bound (a port 0 resolved), once bound
        self.replay_endpoint: str | None = None
        self.sent = 0
        self.dropped = 0  # batches the full queue turned away
        self.fenced = 0  # batches not sent because another ledger holds the lease
        self.replays = 0  # replay requests answered
        self.bound = threading.Event()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._sleeping = False
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # ------------------------------------------------------------------ the engine's side

    def start(self, history: Iterable[tuple[int, bytes]] = ()) -> ZmqEventPublisher:
        """Open the sockets and the thread; `history` (seq, batch), oldest first, is what an
        earlier leader published, kept for replay. An endpoint another process still holds (a
        predecessor on this host that has not exited yet) is bound by the thread once free;
        any other bind error is raised here."""
        self.buffer.extend(history)
        self._pub = self.ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if self.config.replay_endpoint is not None:
            self._replay = self.ctx.socket(zmq.ROUTER)
            # A whole replay and its end marker fit in the pipe of one slow client.
            self._replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
        self._try_bind()
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        return self

    def publish(self, seq: int, batch: bytes) -> bool:
        """Queue one batch; False (and counted) when the queue is full. Never blocks."""
        if self._closing:
            self.fenced += 1  # after a close, or once deposed: nothing more goes out
            return False
        if len(self.queue) >= self.max_queue:
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop(1)
            return False
        self.queue.append((seq, batch))
        if self._sleeping:
            self._wake()
        return True

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued (for up to `timeout`), then close the sockets."""
        if self._thread is None:
            self._close_sockets()
            self._close_pipe()
            return
        self._closing = True
        self.queue.append(_STOP)
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kv_events_zmq_close_timeout", queued=len(self.queue))
            self.queue.clear()
            self.queue.append(_STOP)
            self._wake()
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_pipe()

    def _wake(self) -> None:
        if self._wake_w < 0:
            return
        with contextlib.suppress(BlockingIOError):  # the pipe is full of wake-ups already
            os.write(self._wake_w, b"\0")

    # ------------------------------------------------------------------ the thread

    def _try_bind(self) -> bool:
        """Bind (or connect) whatever is not yet; False while an address is still in use."""
        assert self._pub is not None
        try:
            if self.endpoint is None:
                self.endpoint = _open(self._pub, self.config.endpoint)
            if self._replay is not None and self.replay_endpoint is None:
                self.replay_endpoint = _open(self._replay, self.config.replay_endpoint or "")
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return False
        self.bound.set()
        log.info(
            "kv_events_zmq", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
            topic=self.config.topic, buffer_steps=self.config.buffer_steps, hwm=self.config.hwm,
        )  # fmt: skip
        return True

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a publisher that dies must not go unnoticed
            log.error("kv_events_zmq_crashed", error=repr(exc))
        finally:
            self._closing = True
            self._close_sockets()

    def _loop(self) -> None:
        announced = False
        while not self.bound.is_set():
            if self._try_bind():
                break
            if not announced:
                log.warning("kv_events_zmq_waiting_for_address", endpoint=self.config.endpoint,
                            replay_endpoint=self.config.replay_endpoint)  # fmt: skip
                announced = True
            if self._stop_requested():
                return
            time.sleep(BIND_RETRY_S)
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        pub, queue = self._pub, self.queue
        assert pub is not None
        while True:
            if queue:
                item = queue.popleft()
                if item is _STOP:
                    return
                if not self._may_send():
                    return
                seq, batch = item
                pub.send_multipart((self.topic, seq.to_bytes(8, "big"), batch))
                self.buffer.append(item)
                self.sent += 1
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replays()
                continue
            self._sleeping = True
            if queue:  # a batch came between the check and the flag
                self._sleeping = False
                continue
            ready = dict(poller.poll(1000))
            self._sleeping = False
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
            if self._replay is not None and self._replay in ready:
                self._answer_replays()

    def _stop_requested(self) -> bool:
        return bool(self.queue) and self.queue[-1] is _STOP

    def _may_send(self) -> bool:
        """Wait while the lease may have lapsed (the engine renews it before its next write);
        False once another ledger holds it: this one publishes nothing more."""
        fence = self.fence
        if fence is None:
            return True
        while not fence.held():
            if fence.lost or self._stop_requested():
                if fence.lost:
                    self.fenced += 1 + sum(1 for item in self.queue if item is not _STOP)
                    self.queue.clear()
                    log.warning("kv_events_zmq_fenced", fenced=self.fenced)
                return False
            time.sleep(0.005)
        return True

    def _answer_replays(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("kv_events_replay_refused", frames=len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays += 1
            for seq, batch in list(self.buffer):
                if seq >= start:
                    replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), batch))
            replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1


def _open(sock: zmq.Socket, endpoint: str) -> str:
    """Bind or connect `sock` (see `binds`); the endpoint as bound (port 0 resolved)."""
    if not binds(endpoint):
        sock.connect(endpoint)
        return endpoint
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
