"""Every message that crosses Redis, declared once (see `services.wire.codec` for the encoding).

Streams (names in `services.transport.keys.StreamNames`):
  requests  gateway -> ledger   GenerateRequest, AbortRequest
  routing   gateway -> gateways, indexers   Routed, RoutedEnded, RoutingAlive
  steps     ledger  -> workers  StepMessage (one per scheduler step), WorkerShutdown
  results   workers -> ledger   WorkerHello (registration with capacity), StepResult
  outputs   ledger  -> gateway  OutputBatch per step, RequestOutput for aborts (one stream per gateway)
Keys: StoredResponse (a gateway's /v1/responses answer, `keys.stored_response`).
Parts nested inside messages (SamplingParams, NewRequestData, CachedRequestData, RequestOutput)
are Records. The KV-events stream is not here: it carries vLLM's own `KVEventBatch` bytes (`ledger.events`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from services.wire.codec import Message, Record


class StructuredOutput(Record):
    """A structured-output constraint, compiled by the gateway into llguidance's grammar text
    (`LLMatcher.grammar_from_*`): the worker masks every token the grammar does not allow."""

    kind: str  # what the client asked: json, json_object, regex, choice or grammar
    grammar: str  # llguidance's grammar (its JSON form), valid: the gateway checked it


# vLLM's SamplingParams rules, the one home of them for the gateway, the engine and the worker:
# a positive temperature below MAX_TEMP is raised to it (dividing logits by less overflows the
# softmax), and one below SAMPLING_EPS (0) samples greedily, ignoring top_p, top_k and min_p.
SAMPLING_EPS = 1e-5
MAX_TEMP = 1e-2


def is_greedy(temperature: float) -> bool:
    return temperature < SAMPLING_EPS


def normalized_temperature(temperature: float) -> float:
    return MAX_TEMP if 0 < temperature < MAX_TEMP else temperature


class SamplingParams(Record):
    """vLLM's sampling settings as the worker applies them (batched, in torch)."""

    temperature: float = 0.0  # below 1e-5 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    min_p: float = 0.0  # drop tokens below min_p times the top token's probability
    seed: int | None = None  # per-request generator seed; None draws from the worker's generator
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    eos_token_id: int | None = None  # None: never stop on EOS (ignore_eos)
    presence_penalty: float = 0.0  # subtracted once from every token the output holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (or multiplies) logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # every other token is masked
    bad_words_token_ids: list[list[int]] | None = None  # the last token is banned after the rest
    # Logprobs of the raw logits (vLLM's raw_logprobs mode): None asks for none, k >= 0 for the
    # chosen token's and the k most likely tokens'.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    structured: StructuredOutput | None = None  # structured outputs (response_format, ...)


class TokenLogprobs(Record):
    """Logprobs at one position, as vLLM's per-position dict: the chosen (sampled or prompt)
    token first, then the top-k tokens in rank order (ranks 1..k; the chosen one may repeat)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # the chosen token's rank: 1 + how many tokens are more likely (ties count)


class PromptLogprobs(Record):
    """A prefill chunk's prompt logprobs: entries for prompt positions start, start+1, ..."""

    start: int  # >= 1: the first prompt token has no logprob
    positions: list[TokenLogprobs]


class GenerateRequest(Message, tag="generate"):
    req_id: str
    gateway_id: str  # the gateway whose outputs stream receives this request's tokens
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float  # wall clock, seconds
    priority: int = 0  # lower runs first under the priority policy (vLLM's convention)
    cache_salt: str | None = None
    traceparent: str | None = None  # W3C trace context of the gateway's request span
    # The prompt tokens the router expected this replica to hold when it chose it (None: not
    # routed): the ledger counts an admission that finds fewer (kvledger:routed_hit_shortfall_*).
    expected_cached_tokens: int | None = None


class AbortRequest(Message, tag="abort"):
    req_id: str
    reason: str = "abort"


class NewRequestData(Record):
    """A request the workers have not seen: new, or resumed after a preemption (all its blocks)."""

    req_id: str
    token_ids: list[int]  # every token known so far: the prompt, plus outputs when resumed
    num_prompt_tokens: int
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hit)
    sampling: SamplingParams
    traceparent: str | None = None  # the request's trace: the worker's spans of its work join it
    num_preemptions: int = 0  # > 0: resumed, recomputing what it had computed before


class CachedRequestData(Record):
    """A running request the workers already hold: only what changed since its last step."""

    req_id: str
    # Sequences so that the ledger hands over the core's tuples as they are (a list once decoded).
    new_token_ids: Sequence[int]  # tokens the workers do not know yet (not those they sampled)
    new_block_ids: Sequence[int]  # blocks appended to its block table this step
    num_computed_tokens: int
    traceparent: str | None = None  # unused: the worker keeps the one its NewRequestData carried


class KVTransfer(Record, array_like=True):
    """One copy between the worker's KV cache and its CPU tier: a load copies chunks `src` into
    blocks `dst`, a store blocks `src` into chunks `dst`, pairwise (every layer, K and V)."""

    job_id: int
    src: list[int]
    dst: list[int]


class SharedTransfer(Record, array_like=True):
    """One copy between the shared tier and the worker's CPU tier: a promotion reads `keys`
    from the tier into `chunks`, a cascade writes `chunks` to the tier under `keys`, pairwise
    (each key an offload key: the block hash and its 4-byte group index)."""

    job_id: int
    chunks: list[int]
    keys: list[bytes]


class KVTransfers(Record, omit_defaults=True):
    """The CPU tier's copies of one step (vLLM's OffloadingConnector metadata), in the order a
    worker runs them: the stores named in `flush` first (their blocks are written this step),
    then the loads, then the forward pass, then the other stores. Each is done by the time the
    step's result goes out, which lists it in `transfers_done`."""

    num_cpu_chunks: int  # the tier's size: the worker's host buffer holds this many blocks
    loads: list[KVTransfer] = msgspec.field(default_factory=list)
    stores: list[KVTransfer] = msgspec.field(default_factory=list)
    flush: list[int] = msgspec.field(default_factory=list)  # store job ids
    # The shared tier's copies (ledger.offloading.shared), run after the step's CPU-tier copies
    # and the forward pass: promotions into pending chunks, cascades out of pinned ones, and
    # the data of blocks the catalog evicted (directory backend) to delete.
    promotions: list[SharedTransfer] = msgspec.field(default_factory=list)
    cascades: list[SharedTransfer] = msgspec.field(default_factory=list)
    shared_deletes: list[bytes] = msgspec.field(default_factory=list)
    shared_namespace: str = ""  # what the tier's keys are under (services.tiers.namespace)


class StepMessage(Message, tag="step"):
    """One scheduler step, as vLLM's SchedulerOutput: the workers run exactly this batch.

    For each scheduled request the workers process tokens
    `all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens[req_id]]`,
    write their K/V into slots `block_id * block_size + offset`, and sample one token for every
    request whose chunk reaches the end of its known tokens. A worker appends the tokens it samples
    to its own copy of the request, so the next step can compute them before the ledger has seen
    them; every request carries a seed, so all workers of a group sample the same tokens.
    """

    step_id: int
    epoch: str  # the ledger's start id; workers drop their state when it changes
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: list[str]  # freed since the last step: drop their state
    preempted_req_ids: list[str]  # preempted since the last step: drop their state
    block_size: int
    sent_at: float = 0.0
    # The leader's fencing token (engine.leadership): workers drop steps whose token is
    # below the highest they have seen, so a deposed leader cannot step them.
    leader_token: int = 0
    kv_transfers: KVTransfers | None = None  # the CPU tier's copies (None: none this step)


class WorkerShutdown(Message, tag="worker_shutdown"):
    reason: str = "ledger stopping"


# The KV tiers by name, as the status, /health and /score spell them: the worker's GPU cache,
# its CPU tier (the host buffer, vLLM's medium "CPU"), a shared tier other replicas load from.
TIER_GPU = "gpu"
TIER_CPU = "cpu"
TIER_SHARED = "shared"
TIERS = (TIER_GPU, TIER_CPU, TIER_SHARED)


class WorkerHello(Message, tag="hello"):
    """A worker's registration: who it is and how many KV blocks its memory profile allows."""

    worker_id: str
    group: str
    num_gpu_blocks: int  # blocks its KV cache holds (before the ledger's null block)
    block_size: int
    bytes_per_block: int
    available_kv_bytes: int
    model_name: str
    max_model_len: int
    vocab_size: int
    device: str
    started_at: float
    attention_backend: str = ""  # "cuda" (kernels/csrc) or "torch-reference", chosen at start-up
    detail: str = ""  # the memory profile, for the ledger's start-up log
    tp_rank: int = 0  # under tensor parallelism: this worker's shard of the group's model
    tp_size: int = 1
    # What makes its KV interchangeable with another worker's (gpu_worker.kv_identity, as
    # JSON): the shared tier's namespace binds it.
    kv_identity: str = ""
    # Seconds to load one block into its KV cache from a tier, measured once at start-up (the
    # median of a few copies; "cpu": its host buffer, when the CPU tier is on). None: not
    # measured (no tier, or a worker of an earlier release).
    load_s_per_block: dict[str, float] | None = None


class StepResult(Message, tag="result"):
    step_id: int
    epoch: str
    worker_id: str
    sampled_token_ids: dict[str, int]  # req_id -> the token sampled this step
    logprobs: dict[str, TokenLogprobs] | None = None  # for the requests that ask
    prompt_logprobs: dict[str, PromptLogprobs] | None = None  # for the requests that ask
    execute_seconds: float = 0.0
    error: str | None = None  # set when the worker could not run the step
    leader_token: int = 0  # the step's token, echoed: the ledger drops results of another
    # Set with `error` when the step failed because of these requests alone (req_id -> why):
    # the ledger fails them and re-runs the others.
    failed_requests: dict[str, str] | None = None
    transfers_done: list[int] | None = None  # the step's CPU-tier copies this worker finished
    # Every shared-tier copy of the step -> the indices of its keys this worker failed to copy
    # (empty: all copied); a failed copy is not an error of the step, the block is recomputed.
    shared_failed: dict[int, list[int]] | None = None
    # Of those, the jobs that failed for want of the store (unreachable, timed out, unreadable),
    # not of their blocks: the catalog keeps their keys.
    shared_unreachable: list[int] | None = None
    shared_seconds: list[float] | None = None  # [its shared-tier reads, its writes] this step
    # Seconds this worker's copies took: [before the forward pass (the loads, and the rare
    # flushed stores), after it (the stores)]; None: no copies (or an earlier release).
    transfer_seconds: list[float] | None = None


class RequestOutput(Record, omit_defaults=True):
    """What the ledger tells a gateway about one request after a step (or an abort).

    `omit_defaults`: one goes out per running request per step, mostly with seven of its
    fields at their defaults; leaving those out makes the batch a third of the bytes and half
    the encoding time, and any decoder of this declaration fills them back in (same version).
    `engine.translate.request_output` builds it positionally: keep the field order.
    """

    req_id: str
    new_token_ids: Sequence[int]  # a list once decoded
    position: int = 0  # index of new_token_ids[0] among the outputs: lets a gateway drop repeats
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at (first) admission, in tokens
    num_preemptions: int = 0
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    # Positions 1.. of the prompt (position 0 has none), with the output at position 0.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # With finish_reason "error": the service could not serve it now (no live worker, Redis
    # lost it), not the request's fault nor a crash: the client gets a 503 with Retry-After.
    unavailable: bool = False
    # With the first tokens: seconds from arrival_time to the first admission (vLLM's
    # gen_ai.latency.time_in_queue), for the gateway's GenAI span.
    queued_s: float | None = None


class OutputBatch(Message, tag="outputs"):
    """One step's outputs for one gateway, in one stream entry (one XADD, one read, one decode)."""

    outputs: list[RequestOutput]


class RoutingCosts(Record):
    """What the ledger measures of its own steps, for routers to trade a cached prefix against
    load in seconds (`ledger.step_costs`); 0 where not measured yet."""

    prefill_tokens_per_s: float = 0.0
    step_s_per_seq: float = 0.0  # what each running sequence adds to a step
    step_base_s: float = 0.0  # a step's fixed part
    queue_wait_s: float = 0.0  # recent requests' wait from arrival to admission (decayed mean)
    queued_prefill_tokens: int = 0  # tokens to prefill before a request arriving now (at most)
    max_num_batched_tokens: int = 0
    steps: int = 0  # steps measured since the ledger started
    # Seconds to load one block into the GPU cache from each tier it has (TIER_CPU: the slowest
    # worker's start-up measurement; TIER_SHARED: the shared tier's, measured from its
    # backend); None or a tier missing: not measured (routers then borrow the others' figure).
    load_s_per_block: dict[str, float] | None = None


class EvictionHead(Message, tag="eviction_head"):
    """The cached blocks the ledger's next allocations evict: the front of its free queue at
    `updated_at`, written to its own key (`StreamNames.ledger_eviction`) a few times a second.
    `positions[i]` is how many free blocks come before the block of KV-event hash `hashes[i]`,
    so it survives fewer than positions[i] + 1 allocations; every cached free block not listed
    lies at or beyond `horizon`. `queued_prefill_tokens` were queued to prefill then: what
    allocates before a request sent at `updated_at` is admitted."""

    epoch: str
    updated_at: float
    positions: list[int]
    hashes: list[int]
    horizon: int
    queued_prefill_tokens: int = 0


class Routed(Message, tag="routed"):
    """A gateway sent a request to this replica (the replica's routing stream, shared by every
    gateway and indexer: `services.routing.shared`). Re-sent while the request lasts, so that
    a reader joining late finds it within the last SHARED_TTL_S."""

    gateway_id: str
    req_id: str
    sent_at: float  # wall clock: what the replica's status counts from its updated_at on
    block_hashes: list[int]  # the routable blocks, KV-event form: held there until it ends
    prefill_tokens: int  # what the router expected it to prefill there


class RoutedEnded(Message, tag="routed_ended"):
    """Requests a gateway had sent to this replica have ended."""

    gateway_id: str
    req_ids: list[str]


class RoutingAlive(Message, tag="routing_alive"):
    """A gateway's heartbeat on the replica's routing stream: every request it has pending
    there. Others drop its entries not listed, and all of them once it falls silent."""

    gateway_id: str
    req_ids: list[str]


class SharedTierStatus(Record):
    """The shared tier a ledger reads (`--kv-shared-tier`): replicas with the same namespace
    load each other's blocks from it; blocks and bytes as its catalog last listed them."""

    namespace: str
    backend: str  # "dir" or "redis"
    locality: str
    blocks: int = 0
    bytes: int = 0
    max_bytes: int = 0
    indexed_blocks: int = 0  # what this ledger's index holds of it
    # On a Redis server of its own (redis:URL), whose address is not published: routers that
    # follow the replicas' Redis cannot see its catalog.
    own_server: bool = False


class LedgerStatus(Message, tag="ledger_status"):
    """The ledger's heartbeat key: who is serving, with what capacity, and its live counters."""

    epoch: str
    started_at: float
    updated_at: float
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_gpu_blocks: int
    capacity_line: str
    hash_algo: str
    num_workers: int
    num_running: int = 0
    num_waiting: int = 0
    metrics: dict[str, float] | None = None  # LedgerSnapshot, mirrored by the gateway's /metrics
    attention_backends: dict[str, str] | None = None  # worker id -> the backend it runs
    scheduling_policy: str = "fcfs"  # the gateway refuses priority != 0 under fcfs, as vLLM
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    costs: RoutingCosts | None = None  # for routers: measured step costs and the queue
    max_num_seqs: int = 0  # sequences in one step (0: a ledger that does not say)
    num_cpu_blocks: int = 0  # the CPU tier's size in blocks (0: no CPU tier)
    # The shared tier this replica loads from and stores to (replicas with the same namespace
    # load each other's blocks); None: no shared tier.
    shared_tier: SharedTierStatus | None = None


class StoredResponse(Message, tag="stored_response"):
    """A /v1/responses answer in Redis (gateway --enable-responses-store): the response body as
    returned, and the conversation that led to it (for a later previous_response_id)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
