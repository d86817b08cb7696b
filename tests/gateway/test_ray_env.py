"""Which Ray addresses the CLI joins with this machine's Ray token (gateway/serving/ray_env.py): the clusters on
this machine, which Ray started with token auth once it made its token, and never a cluster elsewhere; the token
kept from the machine's other users."""

from __future__ import annotations

import socket
import stat

from gateway.serving.ray_env import _on_this_machine, keep_token_private


def test_addresses_on_this_machine_are_recognised_in_each_form_ray_takes():
    for address in ("127.0.0.1:6379", "localhost:6391", "ray://127.0.0.1:10001", "[::1]:6379", "auto", "local",
                    f"{socket.gethostname()}:6379"):
        assert _on_this_machine(address), address


def test_a_cluster_on_another_machine_is_not_joined_with_this_machines_token():
    for address in ("192.0.2.10:6379", "ray://198.51.100.7:10001", "no-such-host.invalid:6379"):
        assert not _on_this_machine(address), address


def test_the_ray_token_is_made_readable_by_its_owner_alone(tmp_path, monkeypatch):
    """Ray writes it 0644; anyone who reads it can run code on the cluster as the platform."""
    monkeypatch.setenv("HOME", str(tmp_path))
    keep_token_private()  # no token yet: nothing to do
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("secret")
    token.chmod(0o644)
    keep_token_private()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_text() == "secret"
