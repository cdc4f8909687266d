"""The tokens the ledger streams to the gateways: one OutputBatch per gateway per step, held back
one step so that the round trip overlaps the workers' next step, each outputs stream given its
expiry on every write (a stream nobody writes or reads any more goes away). Every write is the
leader's fenced write (`Leadership.write`): a deposed ledger's tokens never reach a gateway."""

from __future__ import annotations

from engine.leadership import Op, Writer
from engine.translate import Tracked, request_output
from ledger.scheduler import RequestUpdate
from services.transport import redis_streams
from services.transport.keys import OUTPUTS_MAXLEN, OUTPUTS_TTL_S, StreamNames
from services.wire.codec import encode
from services.wire.messages import OutputBatch, RequestOutput


def _ops(stream: str, batch: bytes) -> tuple[Op, Op]:
    xadd = ("XADD", stream, "MAXLEN", "~", OUTPUTS_MAXLEN, "*", redis_streams.FIELD, batch)
    return xadd, ("EXPIRE", stream, OUTPUTS_TTL_S)


class GatewayOutputs:
    def __init__(self, writer: Writer, streams: StreamNames) -> None:
        self.writer = writer
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
        ops: list[Op] = []
        for gateway_id, outs in by_gateway.items():
            ops.extend(_ops(self.streams.outputs(gateway_id), encode(OutputBatch(outputs=outs))))
        await self.writer.write(*ops)

    async def send(self, gateway_id: str, out: RequestOutput) -> None:
        """One output at once (a rejection, an abort, an error), outside the step's batch."""
        stream = self.streams.outputs(gateway_id)
        await self.writer.write(*_ops(stream, encode(OutputBatch(outputs=[out]))))
