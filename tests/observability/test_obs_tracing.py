"""Tracing set-up and the traceparent helpers, against a live OTLP/HTTP receiver.

In-process cases pass set_global=False so that no test leaves a global provider behind; the
process-wide behaviour (global provider, flush at exit, off by default) runs in subprocesses.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from observability import tracing
from observability.tracing import (
    Attr,
    SpanName,
    extract_context,
    format_block_hashes,
    get_tracer,
    inject_traceparent,
    link_from_traceparent,
    links_from_traceparents,
    record_span,
    setup_tracing,
    shutdown_tracing,
)
from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]


def test_request_trace_crosses_services_with_parents_links_and_past_start_times(
    otlp_receiver: OtlpReceiver, clean_otel_env: pytest.MonkeyPatch
) -> None:
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    setup_tracing("kvledger-gateway", set_global=False)
    setup_tracing("kvledger-ledger", set_global=False)
    setup_tracing("kvledger-worker", set_global=False)
    gateway, ledger = get_tracer("kvledger-gateway"), get_tracer("kvledger-ledger")

    # An earlier request stored the blocks that r1's allocation will evict.
    with gateway.start_as_current_span("POST /v1/completions", kind=SpanKind.SERVER):
        stored_by = inject_traceparent()
    enqueued_ns = time.time_ns() - 250_000_000
    with gateway.start_as_current_span("POST /v1/completions", kind=SpanKind.SERVER) as root:
        message_traceparent = inject_traceparent()  # what the gateway puts in the stream entry
        root.set_attributes(
            {
                Attr.GEN_AI_INPUT_TOKENS: 40,
                Attr.GEN_AI_OUTPUT_TOKENS: 8,
                Attr.GEN_AI_CACHE_READ_INPUT_TOKENS: 32,
                Attr.VLLM_LATENCY_TIME_TO_FIRST_TOKEN: 0.12,
            }
        )

    parent = extract_context(message_traceparent)  # the ledger reads the entry
    admitted_ns = time.time_ns()
    record_span(ledger, SpanName.QUEUE, start_ns=enqueued_ns, end_ns=admitted_ns, context=parent)
    with ledger.start_as_current_span(
        SpanName.ADMIT, context=parent, attributes={Attr.PREFIX_HIT_BLOCKS: 2}
    ):
        record_span(
            ledger,
            SpanName.EVICT,
            start_ns=admitted_ns,
            attributes={Attr.EVICTED_BLOCK_HASHES: format_block_hashes([2**64 - 1, 7])},
            links=[link_from_traceparent(stored_by, {Attr.REQUEST_ID: "r0"})],
        )
    get_tracer("kvledger-worker").start_span(
        SpanName.STEP,
        kind=SpanKind.CONSUMER,
        attributes={Attr.BATCH_SIZE: 1},
        links=[link_from_traceparent(message_traceparent, {Attr.REQUEST_ID: "r1"})],
    ).end()

    shutdown_tracing()  # the batch processors hold everything until this flush
    spans = otlp_receiver.wait_for_spans(6, timeout=5)
    roots = [s for s in spans if s["kind"] == "SERVER"]
    stored_root, r1_root = sorted(roots, key=lambda s: s["start_ns"])
    by_name = {s["name"]: s for s in spans if s["kind"] != "SERVER"}
    queue, admit, evict, step = (
        by_name[n] for n in (SpanName.QUEUE, SpanName.ADMIT, SpanName.EVICT, SpanName.STEP)
    )

    assert r1_root["service_name"] == "kvledger-gateway"
    assert r1_root["parent_span_id"] is None
    version, trace_id, span_id, flags = message_traceparent.split("-")
    assert (version, trace_id, span_id) == ("00", r1_root["trace_id"], r1_root["span_id"])
    assert int(flags, 16) & 0x01  # sampled (0x02 marks a random trace id, W3C level 2)
    assert r1_root["attributes"] == {
        "gen_ai.usage.input_tokens": 40,
        "gen_ai.usage.output_tokens": 8,
        "gen_ai.usage.cache_read.input_tokens": 32,
        "gen_ai.latency.time_to_first_token": 0.12,
    }
    for child in (queue, admit):
        assert child["service_name"] == "kvledger-ledger"
        assert (child["trace_id"], child["parent_span_id"]) == (
            r1_root["trace_id"],
            r1_root["span_id"],
        )
    assert (queue["start_ns"], queue["end_ns"]) == (enqueued_ns, admitted_ns)
    assert admit["attributes"] == {"kvledger.prefix_hit.blocks": 2}
    assert (evict["trace_id"], evict["parent_span_id"]) == (r1_root["trace_id"], admit["span_id"])
    assert evict["attributes"] == {
        "kvledger.evicted_block_hashes": ["ffffffffffffffff", "0000000000000007"]
    }
    assert evict["links"] == [
        {
            "trace_id": stored_root["trace_id"],
            "span_id": stored_root["span_id"],
            "attributes": {"kvledger.request_id": "r0"},
        }
    ]
    assert step["service_name"] == "kvledger-worker"
    assert step["parent_span_id"] is None and step["trace_id"] != r1_root["trace_id"]
    assert step["links"] == [
        {
            "trace_id": r1_root["trace_id"],
            "span_id": r1_root["span_id"],
            "attributes": {"kvledger.request_id": "r1"},
        }
    ]


def test_a_step_span_keeps_a_link_to_every_request_in_a_large_batch(
    otlp_receiver: OtlpReceiver, clean_otel_env: pytest.MonkeyPatch
) -> None:
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    setup_tracing("kvledger-worker", set_global=False)
    requests = [
        (f"00-{i + 1:032x}-{i + 1:016x}-01", {Attr.REQUEST_ID: f"r{i}"}) for i in range(300)
    ]
    links = links_from_traceparents([*requests, (None, None), ("garbage", None)])
    get_tracer("kvledger-worker").start_span(SpanName.STEP, links=links).end()
    shutdown_tracing()

    (step,) = otlp_receiver.wait_for_spans(1, timeout=5)
    assert len(step["links"]) == 300  # the SDK's default limit would keep 128
    assert step["links"][299] == {
        "trace_id": f"{300:032x}",
        "span_id": f"{300:016x}",
        "attributes": {"kvledger.request_id": "r299"},
    }


def test_otel_service_name_overrides_the_services_own_name(
    otlp_receiver: OtlpReceiver, clean_otel_env: pytest.MonkeyPatch
) -> None:
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint + "/")
    clean_otel_env.setenv("OTEL_SERVICE_NAME", "ledger-eu-1")
    provider = setup_tracing("kvledger-ledger", set_global=False)
    get_tracer("kvledger-ledger").start_span(SpanName.ADMIT).end()
    shutdown_tracing()

    (span,) = otlp_receiver.wait_for_spans(1, timeout=5)
    assert provider is not None
    assert span["service_name"] == "ledger-eu-1"
    assert span["resource"]["service.namespace"] == "kvledger"


def test_setup_is_idempotent_and_shutdown_is_safe_twice(
    otlp_receiver: OtlpReceiver, clean_otel_env: pytest.MonkeyPatch
) -> None:
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    first = setup_tracing("kvledger-gateway", set_global=False)
    assert setup_tracing("kvledger-gateway", set_global=False) is first
    get_tracer("kvledger-gateway").start_span("once").end()
    shutdown_tracing()
    shutdown_tracing()
    assert [s["name"] for s in otlp_receiver.wait_for_spans(1, timeout=5)] == ["once"]
    assert otlp_receiver.requests == 1


def test_tracing_is_off_and_spans_are_noops_without_configuration(
    clean_otel_env: pytest.MonkeyPatch,
) -> None:
    assert setup_tracing("kvledger-gateway", set_global=False) is None
    assert tracing._providers == {}
    with get_tracer("kvledger-gateway").start_as_current_span("ignored") as span:
        assert not span.is_recording()
        assert inject_traceparent() is None


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "jaeger:4318"},
            "must be a URL such as http://jaeger:4318",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
            },
            "supports http/protobuf or grpc",
        ),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "kvledger knows otlp, console, none"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp"},
            "needs --otlp-traces-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT",
        ),
    ],
)
def test_misconfiguration_fails_with_an_actionable_message(
    clean_otel_env: pytest.MonkeyPatch, variables: dict[str, str], message: str
) -> None:
    for name, value in variables.items():
        clean_otel_env.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        setup_tracing("kvledger-ledger", set_global=False)


def test_grpc_without_its_exporter_package_says_what_to_install(
    clean_otel_env: pytest.MonkeyPatch,
) -> None:
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4317")
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    # None in sys.modules makes the import fail, as on a machine without the package.
    clean_otel_env.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc", None)
    with pytest.raises(RuntimeError, match="pip install opentelemetry-exporter-otlp-proto-grpc"):
        setup_tracing("kvledger-ledger", set_global=False)


@pytest.mark.parametrize(
    "garbage",
    [
        None,
        "",
        "garbage",
        b"\xff\xfe",
        42,
        "00-xyz-abc-01",
        "00-00000000000000000000000000000000-0000000000000000-01",  # all-zero ids are invalid
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # flags missing
    ],
)
def test_garbage_traceparent_gives_an_empty_context_and_no_link(garbage: object) -> None:
    context = extract_context(garbage)  # type: ignore[arg-type]
    assert context == Context()
    assert not trace.get_current_span(context).get_span_context().is_valid
    assert link_from_traceparent(garbage) is None  # type: ignore[arg-type]
    assert inject_traceparent(context) is None


def test_traceparent_round_trips_through_a_message() -> None:
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    span_context = trace.get_current_span(extract_context(traceparent)).get_span_context()
    assert (span_context.trace_id, span_context.span_id) == (
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
    )
    assert span_context.is_remote
    assert inject_traceparent(extract_context(traceparent)) == traceparent
    assert inject_traceparent(span_context) == traceparent
    from_bytes = trace.get_current_span(extract_context(traceparent.encode())).get_span_context()
    assert from_bytes == span_context


def test_record_span_never_ends_before_it_starts() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    start = time.time_ns()
    span = record_span(
        TracerProvider().get_tracer("t"), SpanName.QUEUE, start_ns=start, end_ns=start - 5_000_000
    )  # the ending host's clock runs behind
    assert (span.start_time, span.end_time) == (start, start)  # type: ignore[attr-defined]


def test_block_hashes_from_ints_and_digests_are_hex_like_the_kv_events() -> None:
    digest = bytes(range(32))
    assert format_block_hashes([0, 2**64 - 1, digest]) == [
        "0000000000000000",
        "ffffffffffffffff",
        digest[-8:].hex(),
    ]


_CHILD = """
import os, sys, json
from opentelemetry import trace
from observability.tracing import setup_tracing
provider = setup_tracing("kvledger-gateway")
# third-party code uses the global API, not our get_tracer
trace.get_tracer("aiohttp").start_span("GET /health").end()
print(json.dumps({
    "provider": type(provider).__name__,
    "global_is_ours": trace.get_tracer_provider() is provider,
    "sdk_imported": "opentelemetry.sdk.trace" in sys.modules,
    "otlp_imported": "opentelemetry.exporter.otlp.proto.http.trace_exporter" in sys.modules,
}))
sys.stdout.flush()
"""  # exits without shutdown_tracing: the provider's exit hook must flush


def _run_child(env: dict[str, str]) -> tuple[dict[str, object], str]:
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD)],
        env=base | env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=True,
    )
    first_line, _, rest = done.stdout.partition("\n")
    return json.loads(first_line), rest


def test_a_process_sets_the_global_provider_and_flushes_at_exit(
    otlp_receiver: OtlpReceiver,
) -> None:
    report, _ = _run_child({"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint})
    assert report == {
        "provider": "TracerProvider",
        "global_is_ours": True,
        "sdk_imported": True,
        "otlp_imported": True,
    }
    (span,) = otlp_receiver.wait_for_spans(1, timeout=5)
    assert (span["name"], span["service_name"], span["scope"]) == (
        "GET /health",
        "kvledger-gateway",
        "aiohttp",
    )


def test_unconfigured_process_loads_no_sdk_and_no_exporter() -> None:
    report, _ = _run_child({})
    assert report == {
        "provider": "NoneType",
        "global_is_ours": False,
        "sdk_imported": False,
        "otlp_imported": False,
    }


def test_console_exporter_prints_spans_to_stdout() -> None:
    report, printed = _run_child({"OTEL_TRACES_EXPORTER": "console"})
    assert report["provider"] == "TracerProvider" and not report["otlp_imported"]
    span = json.loads(printed)
    assert span["name"] == "GET /health"
    assert span["resource"]["attributes"]["service.name"] == "kvledger-gateway"


# --- vLLM's flags, sampling --------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/traces", ""])
def test_otlp_traces_endpoint_is_the_traces_url_and_beats_the_base_endpoint(
    otlp_receiver: OtlpReceiver, clean_otel_env: pytest.MonkeyPatch, path: str
) -> None:
    settings = tracing.TracingSettings(
        endpoint="http://127.0.0.1:9/nowhere", traces_endpoint=otlp_receiver.endpoint + path
    )
    setup_tracing("kvledger-gateway", settings, set_global=False)
    get_tracer("kvledger-gateway").start_span("sent").end()
    shutdown_tracing()
    assert [s["name"] for s in otlp_receiver.wait_for_spans(1, timeout=5)] == ["sent"]


def test_the_flags_and_the_otel_variables_make_the_settings(
    clean_otel_env: pytest.MonkeyPatch,
) -> None:
    from kvledger.runtime import tracing_settings
    from services.config import GatewayConfig, from_arguments

    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    clean_otel_env.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    clean_otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")
    clean_otel_env.setenv("KVLEDGER_COLLECT_DETAILED_TRACES", "worker,model")
    settings = tracing_settings(from_arguments(GatewayConfig))
    assert (settings.endpoint, settings.traces_endpoint) == ("http://collector:4318", None)
    assert (settings.sampler, settings.sampler_arg) == ("parentbased_traceidratio", "0.1")
    assert settings.detailed == ("worker", "model")
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://jaeger:4318/v1/traces")
    assert tracing_settings(from_arguments(GatewayConfig)).traces_endpoint == (
        "http://jaeger:4318/v1/traces"
    )


@pytest.mark.parametrize(
    ("sampler", "arg", "message"),
    [
        ("sometimes", None, "kvledger knows parentbased_always_on"),
        ("parentbased_traceidratio", "half", "the sampling ratio is a number from 0 to 1"),
        ("traceidratio", "1.5", "the sampling ratio is a number from 0 to 1"),
    ],
)
def test_a_sampler_that_does_not_parse_fails_with_an_actionable_message(
    clean_otel_env: pytest.MonkeyPatch, sampler: str, arg: str | None, message: str
) -> None:
    settings = tracing.TracingSettings(
        endpoint="http://127.0.0.1:9", sampler=sampler, sampler_arg=arg
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        setup_tracing("kvledger-ledger", settings, set_global=False)


def test_parent_based_ratio_decides_at_the_root_and_children_follow(
    otlp_receiver: OtlpReceiver, clean_otel_env: pytest.MonkeyPatch
) -> None:
    settings = tracing.TracingSettings(
        endpoint=otlp_receiver.endpoint, sampler="parentbased_traceidratio", sampler_arg="0.5"
    )
    setup_tracing("kvledger-gateway", settings, set_global=False)
    setup_tracing("kvledger-ledger", settings, set_global=False)
    gateway, ledger = get_tracer("kvledger-gateway"), get_tracer("kvledger-ledger")
    kept = 0
    for _ in range(200):
        with gateway.start_as_current_span("POST /v1/completions") as root:
            traceparent = inject_traceparent()
            recording = root.is_recording()
        assert traceparent is not None
        sampled = bool(int(traceparent.split("-")[3], 16) & 0x01)
        assert sampled == recording
        kept += sampled
        # The ledger, another process, follows the flag the traceparent carries.
        child = ledger.start_span(SpanName.QUEUE, context=extract_context(traceparent))
        assert child.is_recording() == sampled
        child.end()
    assert 60 < kept < 140  # about half
    shutdown_tracing()
    spans = otlp_receiver.wait_for_spans(2 * kept, timeout=10)
    assert len(spans) == 2 * kept


def test_detailed_traces_need_tracing_on_and_take_vllms_values(
    clean_otel_env: pytest.MonkeyPatch,
) -> None:
    from kvledger.runtime import setup_observability
    from services.config import LedgerConfig, from_arguments
    from services.environment import ConfigError

    clean_otel_env.setenv("KVLEDGER_COLLECT_DETAILED_TRACES", "everything")
    with pytest.raises(ConfigError, match="use model, worker, all"):
        from_arguments(LedgerConfig)
    clean_otel_env.setenv("KVLEDGER_COLLECT_DETAILED_TRACES", "all")
    config = from_arguments(LedgerConfig, redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError, match="--collect-detailed-traces needs tracing on"):
        setup_observability("ledger", config)
