"""Plain-text tables and JSON result files for the command line and the benchmarks."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None
) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(title)
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths, strict=True)
            ).rstrip()
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _numeric(text: str) -> bool:
    stripped = (
        text.replace(",", "").replace(".", "").replace("%", "").replace("x", "").replace("-", "")
    )
    return stripped.isdigit()


def write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def now_stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
