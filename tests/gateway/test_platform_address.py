"""The cluster address `platform up` records under TOLLGATE_HOME: joined while something listens there, forgotten
once nothing does (a record left by a stopped cluster is not retried for minutes)."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("ray")

from gateway.serving.deploy import PLATFORM_ADDRESS_FILE, _recorded_address  # noqa: E402
from gateway.settings import Settings  # noqa: E402


def _settings(tmp_path, address: str) -> Settings:
    (tmp_path / PLATFORM_ADDRESS_FILE).write_text(address + "\n")
    return Settings(home=tmp_path)


def test_a_recorded_cluster_that_listens_is_joined(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        assert _recorded_address(_settings(tmp_path, address)) == address
    assert (tmp_path / PLATFORM_ADDRESS_FILE).is_file()


def test_a_recorded_cluster_that_is_gone_is_forgotten(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on once this socket is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert _recorded_address(_settings(tmp_path, f"127.0.0.1:{port}")) is None
    assert not (tmp_path / PLATFORM_ADDRESS_FILE).exists()
