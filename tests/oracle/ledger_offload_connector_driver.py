"""Our side of the connector differential, in its own process (PYTHONHASHSEED=0, as vLLM's).

Usage: python ledger_offload_connector_driver.py IN.json OUT.json [PLANTED_BUG]. Runs every
workload through offload_sim.Loop against ledger.offloading.connector; a planted bug's name
(test_offload_connector_differential.PLANTED) runs it with that bug.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.oracle.offload_ledger import LedgerConnectorBackend
from tests.oracle.offload_sim import Loop


def main() -> None:
    assert os.environ.get("PYTHONHASHSEED") == "0", "set orders must match vLLM's run"
    source, target = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3:
        from tests.oracle.test_offload_connector_differential import plant

        plant(sys.argv[3])
    with open(source) as f:
        workloads = json.load(f)["workloads"]
    results = []
    for workload in workloads:
        try:
            results.append(Loop(LedgerConnectorBackend(workload["config"]), workload).run())
        except Exception as exc:  # a planted bug may break an invariant: that differs too
            results.append([{"error": f"{type(exc).__name__}: {exc}"}])
    with open(target, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    main()
