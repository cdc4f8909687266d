"""Which requests to fail after a step failed on a worker, so that one bad request cannot make
the ledger re-run the group's work forever.

A worker that can tell which requests broke the step names them: those fail at once and the
rest re-run. A failure nobody can pin on a request counts a strike against every request of
the step; a request that reaches `max_failures` strikes is quarantined (failed with an error).
Pure bookkeeping: the engine loop does the failing.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.wire.messages import StepResult


class Quarantine:
    def __init__(self, max_failures: int) -> None:
        self.max_failures = max(1, max_failures)
        self.strikes: dict[str, int] = {}

    def judge(
        self, scheduled: Iterable[str], failure: StepResult | None
    ) -> tuple[dict[str, str], str]:
        """(req_id -> the error its client gets, the reason for the metric) after a step of
        `scheduled` requests failed; `failure` is the worker's report (None when no worker
        reported one: a timeout or a lost worker is no request's fault)."""
        if failure is None:
            return {}, ""
        if failure.failed_requests:
            errors = failure.failed_requests.items()
            return {r: f"the worker failed on this request: {e}" for r, e in errors}, "worker_error"
        doomed = {}
        for req_id in scheduled:
            strikes = self.strikes[req_id] = self.strikes.get(req_id, 0) + 1
            if strikes >= self.max_failures:
                doomed[req_id] = (
                    f"quarantined: {strikes} steps with this request failed on a worker "
                    f"(--max-request-failures {self.max_failures}); the last error: {failure.error}"
                )
        return doomed, "quarantined"

    def forget(self, req_id: str) -> None:
        self.strikes.pop(req_id, None)
