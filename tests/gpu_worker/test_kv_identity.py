"""The model identity the shared tier's namespace binds (gpu_worker/kv_identity.py): a digest of
the weights files cheap at any size, that still tells apart checkpoints of the same size that
differ in the middle (a fine-tune, a merged LoRA)."""

from __future__ import annotations

from pathlib import Path

from gpu_worker.kv_identity import file_digest

MIB = 1 << 20


def weights(path: Path, size: int = 8 * MIB, changed: tuple[int, int] | None = None) -> Path:
    data = bytearray(bytes(range(256)) * (size // 256))
    if changed is not None:
        start, end = changed
        data[start:end] = bytes(end - start)  # zeroed: another tensor's values
    path.write_bytes(bytes(data))
    return path


def test_the_same_weights_give_the_same_identity_in_any_folder(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = weights(tmp_path / "a" / "model.safetensors")
    second = weights(tmp_path / "b" / "model.safetensors")
    assert file_digest([first]) == file_digest([second])


def test_weights_that_differ_only_in_the_middle_differ(tmp_path):
    base = file_digest([weights(tmp_path / "model.safetensors")])
    # Half a MiB changed 3 MiB in: no header, no size, no first or last MiB differs.
    tuned = file_digest(
        [weights(tmp_path / "model.safetensors", changed=(3 * MIB, 3 * MIB + MIB // 2))]
    )
    assert tuned != base
    # Small files are read whole at both ends.
    small = file_digest([weights(tmp_path / "small.safetensors", size=MIB)])
    assert small != file_digest(
        [weights(tmp_path / "small.safetensors", size=MIB, changed=(10, 20))]
    )
