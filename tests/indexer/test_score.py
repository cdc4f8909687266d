"""The /score request follows the gateway's rules: a cache_salt the gateway refuses is refused
here too, with the same reason, so a router never scores a prompt no request can carry."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.fields import ApiError, read_cache_salt
from indexer.score import ScoreRequestError, read_score_request

NO_TOKENIZER: Any = None  # token-id prompts need none
SALTS = ["", "tenant/a", "a@b", "back\\slash", "nul\x00", "x" * 129, 7, ["s"]]


@pytest.mark.parametrize("salt", SALTS)
def test_a_salt_the_gateway_refuses_is_refused_by_the_indexer_for_the_same_reason(salt):
    with pytest.raises(ApiError) as gateway:
        read_cache_salt(salt)
    with pytest.raises(ScoreRequestError) as indexer:
        read_score_request({"prompt_token_ids": [1, 2, 3], "cache_salt": salt}, NO_TOKENIZER)
    assert str(indexer.value) == f"cache_salt: {gateway.value.message}"


@pytest.mark.parametrize("salt", ["tenant-a", "x" * 128, "ünïcode", None])
def test_a_salt_the_gateway_takes_is_taken_by_the_indexer(salt):
    assert read_cache_salt(salt) == salt
    assert (
        read_score_request({"prompt_token_ids": [1], "cache_salt": salt}, NO_TOKENIZER).cache_salt
        == salt
    )
