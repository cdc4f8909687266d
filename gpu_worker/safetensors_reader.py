"""Read a rank's slice of a safetensors tensor straight into the parameter that will hold it.

safetensors' own `get_slice` maps the whole file and returns a new tensor: the mapped pages a
slice touches count in the process's resident memory until the file closes (a row-parallel
slice touches every page of its tensor), and the returned copy is a second buffer the size of
the slice. Here the file is read with plain positioned reads: a slice of whole rows lands
directly in the parameter's memory, anything else (column slices, a dtype cast, a GPU
parameter) goes through one bounded staging buffer, so a load's peak is its parameters plus
at most STAGING_BYTES. Page-cache pages a read fills are not the process's resident memory.

The format: 8 bytes little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}} (offsets relative to the end of the header), then the data.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

STAGING_BYTES = 16 * 1024 * 1024
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsError(ValueError):
    """A file that is not valid safetensors, or a slice it cannot give; the text names both."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute, in the file

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


class SafetensorsFile:
    """An open safetensors file: `keys()`, `info(name)`, and `read_into(name, out, slices)`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.tensors = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def read_into(
        self,
        name: str,
        out: torch.Tensor,
        slices: tuple[slice, ...] | None = None,
        staging_bytes: int = STAGING_BYTES,
    ) -> tuple[int, ...]:
        """Copy `tensor[slices]` (rows of dim 0, optionally a column range of dim 1) into the
        leading rows of `out`, cast to its dtype; returns the slice's shape. `out` may have more
        rows than the slice (vocabulary padding): those are left as they are."""
        info = self.tensors[name]
        if not info.shape:
            raise SafetensorsError(f"{name} in {self.path.name} is a scalar, not a weight")
        rows, cols = _ranges(info.shape, slices, name, self.path)
        shape = (rows.stop - rows.start, *info.shape[1:])
        if cols is not None:
            shape = (shape[0], len(cols), *shape[2:])
        if tuple(out.shape[1:]) != shape[1:] or out.shape[0] < shape[0]:
            raise SafetensorsError(
                f"{name} in {self.path.name}: slice of shape {list(shape)} does not fit a "
                f"parameter of shape {list(out.shape)}"
            )
        target = out[: shape[0]]
        start = info.offset + rows.start * info.row_bytes
        direct = cols is None and out.dtype == info.dtype and out.device.type == "cpu"
        if direct and target.is_contiguous():
            self._pread_into(target, start)
            return shape
        per_chunk = max(1, staging_bytes // max(1, info.row_bytes))
        staging = torch.empty(min(per_chunk, shape[0]) * info.row_bytes, dtype=torch.uint8)
        for first in range(0, shape[0], per_chunk):
            n = min(per_chunk, shape[0] - first)
            chunk = staging[: n * info.row_bytes]
            self._pread_into(chunk, start + first * info.row_bytes)
            whole_rows = chunk.view(info.dtype).view(n, *info.shape[1:])
            part = whole_rows if cols is None else whole_rows[:, cols.start : cols.stop]
            target[first : first + n].copy_(part)
        return shape

    def _pread_into(self, tensor: torch.Tensor, offset: int) -> None:
        view = memoryview(tensor.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise SafetensorsError(f"{self.path.name} ends before its tensors' data does")
            done += got

    def _read_header(self) -> dict[str, TensorInfo]:
        raw = os.pread(self._fd, 8, 0)
        size = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < size <= _MAX_HEADER_BYTES:
            raise SafetensorsError(
                f"{self.path.name} is not a safetensors file (bad header length)"
            )
        try:
            header = json.loads(os.pread(self._fd, size, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SafetensorsError(f"{self.path.name} has an unreadable header: {exc}") from None
        data_start, file_size = 8 + size, os.fstat(self._fd).st_size
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise SafetensorsError(
                    f"{name} in {self.path.name} has dtype {entry.get('dtype')!r}; kvledger "
                    f"reads {', '.join(DTYPES)}"
                )
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
            if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > file_size:
                raise SafetensorsError(
                    f"{name} in {self.path.name}: data_offsets {[begin, end]} do not hold a "
                    f"{entry['dtype']} tensor of shape {list(shape)} inside the file"
                )
            tensors[name] = TensorInfo(dtype, shape, data_start + begin)
        return tensors


def _ranges(
    shape: tuple[int, ...], slices: tuple[slice, ...] | None, name: str, path: Path
) -> tuple[range, range | None]:
    rows = range(shape[0])
    if not slices:
        return rows, None
    if len(slices) > 2 or any(s.step not in (None, 1) for s in slices):
        raise SafetensorsError(f"{name} in {path.name}: unsupported slice {slices}")
    rows = range(*slices[0].indices(rows.stop))
    if len(slices) == 1 or slices[1] == slice(None):
        return rows, None
    return rows, range(*slices[1].indices(shape[1]))
