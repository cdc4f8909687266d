"""Every Redis key kvledger uses, per replica: one place that names them (StreamNames) and says
how long the short-lived ones live."""

from __future__ import annotations

from dataclasses import dataclass

# A gateway's outputs stream lives this long after the ledger last wrote to it or its reader
# last refreshed it: the streams of gateways that restarted (a new id each start) or never
# existed (a request naming an unknown gateway) go away on their own.
OUTPUTS_TTL_S = 600
# A gateway renews its marker every second with this expiry (--gateway-lease-s): a marker that
# is gone means the gateway is dead (or Redis lost its data), and a ledger aborts its requests.
GATEWAY_LEASE_S = 15.0

# Every stream's cap, in entries (XADD MAXLEN ~: Redis trims whole listpack nodes of up to 100
# entries, so a stream may hold up to a node more). The KV-events stream's is a memory budget
# instead (--kv-events-max-mb). docs/operations.md's Redis sizing table multiplies these by the
# measured entry sizes (benchmarks/redis_sizing.py), and tests/services/transport/
# test_redis_sizing.py fills every stream to its cap to hold the table to what Redis uses.
REQUESTS_MAXLEN = 100_000  # per replica: requests and aborts from every gateway
OUTPUTS_MAXLEN = 100_000  # per replica and gateway: one entry per step with its outputs
STEPS_MAXLEN = 10_000  # per replica and worker group: one entry per step
RESULTS_MAXLEN = 10_000  # per replica: one entry per step and worker
DEAD_LETTERS_MAXLEN = 10_000  # per replica


@dataclass(slots=True)
class StreamNames:
    """Every Redis key of one replica (a ledger and its workers): `{prefix}:{{{replica}}}:...`.
    The replica's name is a hash tag, so all of one replica's keys live in one slot of a Redis
    Cluster (multi-stream reads and pipelines need that) and replicas spread over the masters."""

    prefix: str = "kvl"
    replica: str = "default"

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.replica}}}"

    @property
    def requests(self) -> str:
        return f"{self.base}:requests"

    @property
    def results(self) -> str:
        return f"{self.base}:results"

    @property
    def events(self) -> str:
        return f"{self.base}:kv-events"

    @property
    def events_snapshot(self) -> str:
        return f"{self.base}:kv-events:snapshot"

    @property
    def dead_letters(self) -> str:
        return f"{self.base}:dead-letters"

    @property
    def ledger_status(self) -> str:
        return f"{self.base}:ledger:status"

    @property
    def routing(self) -> str:
        """What every gateway sent to this replica and is pending there (Routed, RoutedEnded,
        RoutingAlive): trimmed to the last minutes, gone once no gateway writes."""
        return f"{self.base}:routing"

    @property
    def ledger_eviction(self) -> str:
        """The ledger's eviction head (`EvictionHead`), for routers; expires with the status."""
        return f"{self.base}:ledger:eviction"

    @property
    def leader(self) -> str:
        """The ledger lease: who leads this replica (engine.leadership)."""
        return f"{self.base}:ledger:leader"

    @property
    def leader_token(self) -> str:
        """The leaders' fencing counter: each new leader's token is above every earlier one."""
        return f"{self.base}:ledger:leader-token"

    def steps(self, group: str) -> str:
        return f"{self.base}:steps:{group}"

    def outputs(self, gateway_id: str) -> str:
        """A gateway's outputs stream; it expires OUTPUTS_TTL_S after the last write or read."""
        return f"{self.base}:outputs:{gateway_id}"

    def gateway_marker(self, gateway_id: str) -> str:
        """A key the gateway renews: its absence means Redis lost its data (see
        gateway.output_reader) or the gateway is gone (the ledger aborts its requests)."""
        return f"{self.base}:gateways:{gateway_id}"

    def worker(self, group: str, worker_id: str) -> str:
        """A worker's registration key (`*` as worker_id: the pattern of the group's keys)."""
        return f"{self.base}:workers:{group}:{worker_id}"

    def tp_rendezvous(self, group: str, epoch: str) -> str:
        """Where rank 0 of a tensor-parallel group publishes its store's host:port for an epoch."""
        return f"{self.base}:tp:{group}:{epoch}"


@dataclass(frozen=True, slots=True)
class SharedTierKeys:
    """Every Redis key of one shared-tier namespace (`services/tiers`), outside every replica:
    `{prefix}:{{kvs:<namespace>}}:...`, one hash slot, so the catalog's script sees them all."""

    prefix: str
    namespace: str

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{kvs:{self.namespace}}}"

    @property
    def index(self) -> str:
        """Sorted set: every block the tier holds (offload key bytes) -> its last use (ms)."""
        return f"{self.base}:index"

    @property
    def size(self) -> str:
        """The bytes the listed blocks take (every rank's)."""
        return f"{self.base}:bytes"

    @property
    def log(self) -> str:
        """Stream of the catalog's changes (services/tiers/catalog.py)."""
        return f"{self.base}:log"

    @property
    def seq(self) -> str:
        return f"{self.base}:seq"

    @property
    def fence(self) -> str:
        """Hash: replica -> the highest leader token that wrote the catalog."""
        return f"{self.base}:fence"

    @property
    def origin(self) -> str:
        """Hash: offload key -> the replica that first wrote the block (a trace names it)."""
        return f"{self.base}:origin"

    @property
    def sweeper(self) -> str:
        """A directory backend's sweep lease: the worker holding it deletes the files no catalog
        lists, once an interval fleet-wide (gpu_worker/shared_tier.py)."""
        return f"{self.base}:sweeper"

    @property
    def catalog(self) -> list[str]:
        """The catalog's keys, as its script takes them."""
        return [self.index, self.log, self.size, self.fence, self.seq, self.origin]

    @property
    def data_prefix(self) -> bytes:
        """A Redis backend's values: this, the offload key's bytes, then `:r<rank>`."""
        return f"{self.base}:d:".encode()

    def data(self, key: bytes, rank: int) -> bytes:
        return self.data_prefix + key + b":r" + str(rank).encode()


def stored_response(prefix: str, response_id: str) -> str:
    """A /v1/responses answer kept for previous_response_id (gateway --enable-responses-store).
    Outside every replica: any gateway of the prefix reads it."""
    return f"{prefix}:responses:{response_id}"
