"""The tokens the ledger streams to the gateways: one OutputBatch per gateway per step, held back
one step so that the round trip overlaps the workers' next step, each outputs stream given its
expiry on every write (a stream nobody writes or reads any more goes away)."""

from __future__ import annotations

import redis.asyncio as aioredis

from engine.translate import Tracked, request_output
from ledger.scheduler import RequestUpdate
from services.transport import redis_streams
from services.transport.keys import OUTPUTS_MAXLEN, OUTPUTS_TTL_S, StreamNames
from services.wire.codec import encode
from services.wire.messages import OutputBatch, RequestOutput


class GatewayOutputs:
    def __init__(self, r: aioredis.Redis, streams: StreamNames) -> None:
        self.r = r
        self.streams = streams
        # The last step's results, sent to the gateways while the workers run the next step.
        self.unsent: list[RequestUpdate[Tracked]] = []

    def hold(self, updates: list[RequestUpdate[Tracked]]) -> None:
        self.unsent.extend(updates)

    async def flush(self) -> list[RequestUpdate[Tracked]]:
        """Append every held update; returns them (the caller finishes the finished ones). On a
        Redis error they stay held, to be sent after the outage: no token is skipped."""
        updates, self.unsent = self.unsent, []
        if not updates:
            return updates
        try:
            await self._append(updates)
        except BaseException:
            self.unsent = updates + self.unsent
            raise
        return updates

    async def _append(self, updates: list[RequestUpdate[Tracked]]) -> None:
        by_gateway: dict[str, list[RequestOutput]] = {}
        for update in updates:
            request = update.request
            out = request_output(request, update.new_token_ids, update.finish_reason)
            outs = by_gateway.get(gateway_id := request.payload.msg.gateway_id)
            if outs is None:
                outs = by_gateway[gateway_id] = []
            outs.append(out)
        async with self.r.pipeline(transaction=False) as pipe:
            for gateway_id, outs in by_gateway.items():
                stream = self.streams.outputs(gateway_id)
                batch = encode(OutputBatch(outputs=outs))
                pipe.xadd(
                    stream, {redis_streams.FIELD: batch}, maxlen=OUTPUTS_MAXLEN, approximate=True
                )
                pipe.expire(stream, OUTPUTS_TTL_S)
            await pipe.execute()

    async def send(self, gateway_id: str, out: RequestOutput) -> None:
        """One output at once (a rejection, an abort, an error), outside the step's batch."""
        stream = self.streams.outputs(gateway_id)
        await redis_streams.append(self.r, stream, OutputBatch(outputs=[out]), OUTPUTS_MAXLEN)
        await self.r.expire(stream, OUTPUTS_TTL_S)
