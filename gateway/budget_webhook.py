"""Soft-budget alerts to an operator's webhook: each alert the ledger claims (billing/budget_alerts.py) is POSTed as
JSON to TOLLGATE_BUDGET_ALERT_WEBHOOK from a thread of its own, so the ledger's writer never waits on it. A failed
POST is retried (1 s, 2 s, 4 s) and then logged; the alert stays recorded in `budget_alerts` either way."""

from __future__ import annotations

import logging
import queue
import threading
import time

import httpx

from billing.budget_alerts import SoftBudgetCrossed

log = logging.getLogger("tollgate.budget_webhook")

ATTEMPTS = 4


class BudgetWebhook:
    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self._timeout_s = timeout_s
        self._queue: queue.Queue[SoftBudgetCrossed | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tollgate-budget-webhook", daemon=True)
        self._thread.start()
        self.sent = 0

    def __call__(self, crossed: list[SoftBudgetCrossed]) -> None:
        for alert in crossed:
            self._queue.put(alert)

    def close(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        with httpx.Client(timeout=self._timeout_s) as client:
            while (alert := self._queue.get()) is not None:
                self._post(client, alert)

    def _post(self, client: httpx.Client, alert: SoftBudgetCrossed) -> None:
        for attempt in range(ATTEMPTS):
            try:
                client.post(self.url, json=alert.as_json()).raise_for_status()
                self.sent += 1
                return
            except httpx.HTTPError as e:
                if attempt == ATTEMPTS - 1:
                    log.error("budget alert for %s %s not delivered to the webhook: %s", alert.scope, alert.name, e)
                    return
                time.sleep(2**attempt)
