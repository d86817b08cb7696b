"""Ray's environment for the CLI's processes, set before Ray is imported (it reads it at import)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def use_local_token_auth() -> None:
    """The cluster `platform up` started on this machine uses Ray's token auth with this machine's token
    (~/.ray/auth_token); Ray turns it on by itself only for clusters it finds, not for an address it is
    given, as the platform's recorded one is."""
    if "ray" in sys.modules:  # too late to take effect, and a mode Ray's imported half does not share breaks it
        return
    if (Path.home() / ".ray" / "auth_token").is_file():
        os.environ.setdefault("RAY_AUTH_MODE", "token")
