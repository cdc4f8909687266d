"""Following a vLLM-style ZMQ KV-events publisher: every batch once, in order, gaps filled by
replay, and a restarted publisher told apart from one that is merely ahead.

vLLM 0.33's ZmqEventPublisher (and kvledger's, `engine/zmq_events.py`) sends each batch on a PUB
socket as `(topic, seq: 8 bytes big-endian, payload)` and keeps the last `buffer_steps` batches
for a ROUTER socket that answers a start sequence with every kept batch from there on, then
`seq = -1`. A publisher that restarts counts from 0 again, and nothing else says so.

`ZmqFollower` hands out `Batch(seq, payload)` in sequence order and `Reset(reason)` when the
batches before can no longer be trusted to continue: the publisher restarted (a live sequence
went back, or the batch at the last sequence applied is not the one applied), or batches were
lost for good (the replay buffer no longer holds them). After a Reset it starts over from the
oldest batch the publisher still keeps. Every gap is filled by a replay that starts at the last
batch applied and must return it byte for byte, so a publisher restarted while the follower was
away (or while its subscription reconnected) is caught even when its new sequence is already
past the old one. Without a replay endpoint a gap is a Reset. A replay answer that stops coming
(the publisher died mid-answer) is asked for again on a fresh socket after `replay_timeout_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import zmq
import zmq.asyncio

END_OF_REPLAY = -1
SUB_HWM = 100_000  # live batches held for a slow reader; past it ZMQ drops and replay fills in
IDLE_CHECK_S = 1.0
# A replay answer that stops coming (the publisher restarted or went away mid-answer) is asked
# for again, on a fresh socket, after this long without a message of it.
REPLAY_TIMEOUT_S = 5.0
# Messages read a socket per poll() at most: a backlog (a whole replay) is handed out in parts,
# so the caller's loop runs its other tasks (a lease renewal) in between.
MAX_READ = 512


class Batch(NamedTuple):
    seq: int
    payload: bytes


class Reset(NamedTuple):
    reason: str


Item = Batch | Reset


class ZmqFollower:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        context: zmq.asyncio.Context | None = None,
        idle_check_s: float = IDLE_CHECK_S,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
    ) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self.ctx = context or zmq.asyncio.Context.instance()
        self.idle_check_s = idle_check_s
        self.replay_timeout_s = replay_timeout_s
        self.replay_heard = time.monotonic()  # when the request was sent or last answered
        self.sub: zmq.asyncio.Socket | None = None
        self.dealer: zmq.asyncio.Socket | None = None
        # The same sockets without asyncio's futures, for reading what is already queued: one
        # awaited recv cost ~30 us of the loop's time a message (a bridge's whole budget per
        # batch is ~100 us), a plain non-blocking one ~2 us.
        self._sub_now: zmq.Socket | None = None
        self._dealer_now: zmq.Socket | None = None
        self.last: tuple[int, bytes] | None = None  # the last batch handed out (or resumed at)
        self.expect: int | None = None  # the next sequence wanted (None: whatever comes first)
        self.verify: tuple[int, bytes] | None = None  # what the answer in flight must start with
        self.replaying = False
        self.discarding = False  # the rest of the answer in flight is from before a Reset
        self.stash: dict[int, bytes] = {}  # live batches past a gap or during a replay
        self.last_live: int | None = None
        self.last_activity = time.monotonic()
        self.out: list[Item] = []
        self.replays = self.resets = self.live = self.replay_retries = 0

    def open(self, resume: tuple[int, bytes] | None = None) -> ZmqFollower:
        """Connect; `resume` is the (seq, payload) of the last batch applied before (a restarted
        follower), checked against the publisher's replay before anything after it is taken."""
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.setsockopt(zmq.RCVHWM, SUB_HWM)
        self.sub.connect(self.endpoint)
        self._sub_now = zmq.Socket.shadow(self.sub.underlying)
        self._connect_replay()
        self.last = resume
        self.expect = None if resume is None else resume[0] + 1
        self._catch_up()
        return self

    async def poll(self, timeout_s: float) -> list[Item]:
        """What arrived within `timeout_s` (or at once, if something is ready), in order."""
        assert self.sub is not None
        poller = zmq.asyncio.Poller()
        poller.register(self.sub, zmq.POLLIN)
        if self.dealer is not None:
            poller.register(self.dealer, zmq.POLLIN)
        ready = dict(await poller.poll(int(timeout_s * 1000)))
        if self.dealer is not None and self.dealer in ready:
            assert self._dealer_now is not None
            _drain(self._dealer_now, self._replayed)
        if self.sub in ready:
            assert self._sub_now is not None
            _drain(self._sub_now, self._live)
        if self.dealer is not None and self.dealer in ready:
            self.replay_heard = time.monotonic()
        if self.replaying and time.monotonic() - self.replay_heard >= self.replay_timeout_s:
            self.replay_retries += 1
            self._connect_replay()
            self.discarding = False  # (after a Reset the last batch is None: from 0)
            self._catch_up()
        if ready:
            self.last_activity = time.monotonic()
        elif (
            not self.replaying
            and self.dealer is not None
            and time.monotonic() - self.last_activity >= self.idle_check_s
        ):
            # Nothing for a while: batches published before the subscription took (or a
            # restart with nothing since) show only through the replay socket.
            self.last_activity = time.monotonic()
            self._catch_up()
        out, self.out = self.out, []
        return out

    def _connect_replay(self) -> None:
        if self.replay_endpoint is None:
            return
        if self.dealer is not None:
            self.dealer.close(linger=0)  # a late answer to the old request goes nowhere
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.RCVHWM, 0)
        self.dealer.connect(self.replay_endpoint)
        self._dealer_now = zmq.Socket.shadow(self.dealer.underlying)

    def close(self) -> None:
        for sock in (self.sub, self.dealer):
            if sock is not None:
                sock.close(linger=0)

    # ------------------------------------------------------------------ the state machine

    def _ask(self, start: int, verify: tuple[int, bytes] | None) -> None:
        assert self.dealer is not None
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        self.replaying, self.verify = True, verify
        self.replay_heard = time.monotonic()
        self.replays += 1

    def _catch_up(self) -> None:
        """Ask for everything after the last batch (and that batch, to check it)."""
        if self.dealer is None:
            return
        if self.last is None:
            self._ask(0, None)
        else:
            self._ask(self.last[0], self.last)

    def _take(self, seq: int, payload: bytes) -> None:
        self.out.append(Batch(seq, payload))
        self.last, self.expect = (seq, payload), seq + 1

    def _reset(self, reason: str) -> None:
        self.out.append(Reset(reason))
        self.resets += 1
        self.stash.clear()
        self.last = self.expect = self.verify = None
        if self.dealer is None:
            return
        if self.replaying:
            self.discarding = True  # ask again once this answer has ended
        else:
            self._ask(0, None)

    def _live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            return  # not a KV-events message
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        self.live += 1
        if self.last_live is not None and seq <= self.last_live:
            self._reset(f"the publisher restarted: live sequence {self.last_live} then {seq}")
        self.last_live = seq
        if self.replaying:
            self.stash[seq] = payload
        elif self.expect is None or seq == self.expect:
            self._take(seq, payload)
        elif seq > self.expect:
            if self.dealer is None:
                self._reset(f"batches {self.expect}..{seq - 1} missed and no replay endpoint")
                self._take(seq, payload)
            else:
                self.stash[seq] = payload
                self._catch_up()

    def _replayed(self, frames: list[bytes]) -> None:
        if len(frames) != 4 or len(frames[2]) != 8:
            return
        _, _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == END_OF_REPLAY:
            self._replay_ended()
            return
        if self.discarding:
            return
        if self.verify is not None:
            want, self.verify = self.verify, None
            if seq == want[0] and payload == want[1]:
                return  # the same publisher: go on after it
            if seq == want[0]:
                self._reset(f"the publisher restarted: batch {seq} is not the one applied")
            else:
                self._reset(f"batches from {want[0]} on are no longer kept (oldest now {seq})")
            return
        if self.expect is None or seq == self.expect:
            self._take(seq, payload)
        elif seq > self.expect:
            self._reset(f"batches {self.expect}..{seq - 1} are no longer kept")
            self.discarding = False  # this answer is the new start: take it from here
            self._take(seq, payload)

    def _replay_ended(self) -> None:
        self.replaying = False
        if self.discarding:
            self.discarding = False
            self._ask(0, None)
            return
        if self.verify is not None:
            want = self.verify[0]
            self._reset(f"the publisher restarted: its replay ends before batch {want}")
            return
        for seq in sorted(self.stash):
            payload = self.stash.pop(seq)
            if self.expect is None or seq == self.expect:
                self._take(seq, payload)
            elif seq > self.expect:
                self.stash[seq] = payload
                break
        if self.stash:  # still a gap (the batch before came while this answer was built)
            self._catch_up()


def _drain(sock: zmq.Socket, handle: Callable[[list[bytes]], None]) -> None:
    """Hand `handle` what `sock` holds now, MAX_READ messages at most, without waiting."""
    recv = sock.recv_multipart
    try:
        for _ in range(MAX_READ):
            handle(recv(zmq.NOBLOCK))
    except zmq.Again:
        pass
