"""The positioned-read safetensors reader gives exactly what safetensors' own loader gives, for
whole tensors, row and column slices, dtype casts and padded targets, in one read or many
staging chunks; files that are not safetensors are refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.safetensors_reader import SafetensorsError, SafetensorsFile


@pytest.fixture
def weights(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w32": torch.randn(37, 11, generator=gen),
        "w16": torch.randn(9, 20, generator=gen).to(torch.bfloat16),
        "half": torch.randn(6, 5, generator=gen).to(torch.float16),
        "bias": torch.randn(13, generator=gen),
        "cube": torch.randn(4, 3, 2, generator=gen),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, load_file(str(path))


@pytest.mark.parametrize("staging_bytes", [1, 40, 1 << 20])
@pytest.mark.parametrize(
    ("name", "slices", "dtype"),
    [
        ("w32", None, torch.float32),
        ("w32", (slice(10, 29), slice(None)), torch.float32),
        ("w32", (slice(None), slice(3, 8)), torch.float32),
        ("w32", (slice(5, 9), slice(0, 4)), torch.float64),
        ("w16", (slice(None), slice(10, 20)), torch.bfloat16),
        ("w16", (slice(2, 7), slice(None)), torch.float32),
        ("half", None, torch.float32),
        ("bias", (slice(4, 13),), torch.float32),
        ("cube", (slice(1, 3),), torch.float32),
    ],
)
def test_read_into_equals_safetensors_slice(weights, name, slices, dtype, staging_bytes):
    path, reference = weights
    expected = reference[name] if slices is None else reference[name][slices]
    out = torch.full(expected.shape, float("nan"), dtype=dtype)
    with SafetensorsFile(path) as reader:
        shape = reader.read_into(name, out, slices, staging_bytes=staging_bytes)
    assert shape == tuple(expected.shape)
    assert torch.equal(out, expected.to(dtype))


def test_padding_rows_beyond_the_slice_are_left_alone(weights):
    path, reference = weights
    out = torch.full((12, 11), 7.0)
    with SafetensorsFile(path) as reader:
        assert reader.read_into("w32", out, (slice(30, 40), slice(None))) == (7, 11)
    assert torch.equal(out[:7], reference["w32"][30:])
    assert torch.equal(out[7:], torch.full((5, 11), 7.0))


def test_keys_and_info_describe_the_header(weights):
    path, reference = weights
    with SafetensorsFile(path) as reader:
        assert sorted(reader.keys()) == sorted(reference)
        assert reader.info("w16").shape == (9, 20)
        assert reader.info("w16").dtype == torch.bfloat16


def test_a_slice_that_does_not_fit_the_parameter_is_refused(weights):
    path, _ = weights
    with SafetensorsFile(path) as reader, pytest.raises(SafetensorsError, match="does not fit"):
        reader.read_into("w32", torch.empty(37, 10), None)


def test_files_that_are_not_safetensors_are_refused(tmp_path, weights):
    path, _ = weights
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(SafetensorsError, match=r"junk\.safetensors is not a safetensors file"):
        SafetensorsFile(junk)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(SafetensorsError, match=r"cut\.safetensors: data_offsets"):
        SafetensorsFile(cut)
