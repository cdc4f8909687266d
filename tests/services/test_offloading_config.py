"""The CPU tier's configuration: vLLM's --kv-offloading-size and --kv-transfer-config, taken as
vLLM takes them, anything kvledger does not run refused with the field's name."""

from __future__ import annotations

import argparse
import json

import pytest

from kvledger.launcher import check_offloading
from services.config import (
    LedgerConfig,
    OffloadingConfig,
    from_arguments,
    parse_kv_transfer_config,
)
from services.environment import ConfigError


def transfer(**extra) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )


def test_the_tier_is_off_unless_asked_for():
    assert LedgerConfig().offloading is None


def test_kv_offloading_size_is_gib_as_vllm_counts_it():
    assert LedgerConfig(kv_offloading_size=0.5).offloading == OffloadingConfig(
        cpu_bytes_to_use=1 << 29
    )


def test_kv_transfer_config_takes_vllms_shape_and_the_size_overrides_its_bytes():
    extra = parse_kv_transfer_config(transfer(eviction_policy="arc", cpu_bytes_to_use=4096))
    assert LedgerConfig(kv_transfer_config=extra).offloading == OffloadingConfig(
        cpu_bytes_to_use=4096, eviction_policy="arc"
    )
    both = LedgerConfig(kv_transfer_config=extra, kv_offloading_size=2).offloading
    assert both is not None and both.cpu_bytes_to_use == 2 << 30
    assert both.eviction_policy == "arc"


@pytest.mark.parametrize(
    "text, named",
    [
        ("[]", "JSON object"),
        ('{"kv_connector": "NixlConnector"}', "field 'kv_connector'"),
        ('{"kv_role": "kv_both"}', "field 'kv_connector'"),
        ('{"kv_connector": "OffloadingConnector", "kv_role": "kv_consumer"}', "field 'kv_role'"),
        ('{"kv_connector": "OffloadingConnector", "kv_port": 1}', "field 'kv_port'"),
        (transfer(eviction_policy="lfu"), "'kv_connector_extra_config.eviction_policy'"),
        (transfer(blocks_per_chunk=2), "'kv_connector_extra_config.blocks_per_chunk'"),
        (transfer(spec_name="TieringSpec"), "'kv_connector_extra_config.spec_name'"),
        (transfer(secondary_tiers=[]), "'kv_connector_extra_config.secondary_tiers'"),
        (transfer(store_threshold="2"), "'kv_connector_extra_config.store_threshold'"),
        (transfer(cpu_bytes_to_use=-1), "'kv_connector_extra_config.cpu_bytes_to_use'"),
        (transfer(sync_load_budget_bytes=-1), "'kv_connector_extra_config.sync_load_budget_bytes'"),
        (
            transfer(sync_load_budget_bytes=1.5),
            "'kv_connector_extra_config.sync_load_budget_bytes'",
        ),
    ],
)
def test_kv_transfer_config_refuses_what_kvledger_does_not_run_by_field(text, named):
    with pytest.raises(ValueError, match=named):
        parse_kv_transfer_config(text)


def test_the_sync_load_budget_is_vllms_key_and_off_by_default():
    assert OffloadingConfig(cpu_bytes_to_use=1).sync_load_budget_bytes == 0
    extra = parse_kv_transfer_config(transfer(sync_load_budget_bytes=1 << 26))
    tier = LedgerConfig(kv_transfer_config=extra, kv_offloading_size=1).offloading
    assert tier is not None and tier.sync_load_budget_bytes == 1 << 26


def test_a_tier_without_a_size_or_of_another_block_size_is_refused():
    with pytest.raises(ConfigError, match="cpu_bytes_to_use' must be given"):
        LedgerConfig(kv_transfer_config=parse_kv_transfer_config(transfer()))
    with pytest.raises(ConfigError, match="must equal the GPU block size"):
        LedgerConfig(kv_offloading_size=1, kv_transfer_config={"block_size": 32}, block_size=16)


def test_the_environment_sets_the_tier(monkeypatch):
    monkeypatch.setenv("KVLEDGER_KV_TRANSFER_CONFIG", transfer(eviction_policy="arc"))
    monkeypatch.setenv("KVLEDGER_KV_OFFLOADING_SIZE", "0.25")
    config = from_arguments(LedgerConfig)
    assert config.offloading == OffloadingConfig(cpu_bytes_to_use=1 << 28, eviction_policy="arc")


def test_up_refuses_a_bad_tier_before_starting_anything(monkeypatch):
    monkeypatch.delenv("KVLEDGER_KV_OFFLOADING_SIZE", raising=False)
    args = argparse.Namespace(
        kv_offloading_size=None, kv_transfer_config='{"kv_connector": "X"}', block_size=None
    )
    with pytest.raises(ConfigError, match="--kv-transfer-config: field 'kv_connector'"):
        check_offloading(args)
    args.kv_transfer_config = transfer(eviction_policy="arc")
    args.kv_offloading_size = "1"
    check_offloading(args)


def test_up_hands_the_tier_to_the_ledger_and_the_worker():
    from kvledger import launcher

    parser = argparse.ArgumentParser()
    launcher.add_parser(parser.add_subparsers())
    text = transfer(eviction_policy="arc")
    args = parser.parse_args(["up", "--kv-offloading-size", "2", "--kv-transfer-config", text])
    assert launcher.role_flags(args, "ledger") == [
        "--kv-offloading-size", "2", "--kv-transfer-config", text,
    ]  # fmt: skip
    # The worker measures what a load from the tier costs when it is on (its hello).
    assert launcher.role_flags(args, "worker") == launcher.role_flags(args, "ledger")
    assert launcher.role_flags(args, "gateway") == []
