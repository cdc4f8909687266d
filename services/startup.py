"""What a service does once it is built, before it serves: move start-up's objects out of GC.

Everything alive after start-up (modules, the model's Python objects, the block pool's
KVCacheBlocks, the tokenizer) lives as long as the process. Left in the oldest generation it
is walked by every full collection, and it sets how often those come; `gc.freeze()` moves it to
the permanent generation (as vLLM's engine does after start-up), so a full collection walks only
what serving made. The collector stays on for everything allocated afterwards.
"""

from __future__ import annotations

import gc


def freeze_after_startup() -> int:
    """Collect start-up's garbage, then freeze what is left; returns how many objects froze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
