"""Stopping the platform when Serve cannot be asked about the gateway (its controller gone, say): the drain gives up
with a warning naming why, and the stop goes on (gateway/serving/stop.py)."""

from __future__ import annotations

import logging

from ray import serve

from gateway.serving.stop import drain_gateway
from gateway.settings import Settings


def test_a_serve_that_cannot_answer_is_drained_of_nothing(monkeypatch, caplog) -> None:
    def controller_gone() -> None:
        raise RuntimeError("the Serve controller is gone")

    monkeypatch.setattr(serve, "status", controller_gone)
    with caplog.at_level(logging.WARNING, logger="tollgate.platform"):
        assert drain_gateway(Settings()) == 0
    assert "gateway drain failed: the Serve controller is gone" in caplog.text


def test_a_platform_without_its_gateway_has_nothing_to_drain(monkeypatch) -> None:
    monkeypatch.setattr(serve, "status", lambda: type("Status", (), {"applications": {}})())
    assert drain_gateway(Settings()) == 0
