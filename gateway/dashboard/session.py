"""The dashboard's session: a signed cookie (HMAC-SHA256) holding a random session id, the admin key's
id once signed in (None before), and an expiry. The CSRF token is derived from the session id, so
every session has its own and no server-side store is needed; sign-out remembers the id until expiry."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass

from gateway.settings import Settings

COOKIE = "tollgate_admin"
SIGNED_IN_TTL_S = 8 * 3600
ANONYMOUS_TTL_S = 3600


def session_secret(settings: Settings) -> bytes:
    """Derived from the admin key when one is configured (the same in every gateway process),
    otherwise random per process (sessions then end when the process does)."""
    if settings.admin_key is not None:
        material = settings.admin_key.get_secret_value().encode()
        return hmac.new(material, b"tollgate-dashboard-session-v1", hashlib.sha256).digest()
    return secrets.token_bytes(32)


@dataclass(frozen=True)
class AdminSession:
    sid: str
    key_id: int | None  # None: not signed in yet (the sign-in form's session)
    expires: int

    @property
    def signed_in(self) -> bool:
        return self.key_id is not None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SessionCodec:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._ended: dict[str, int] = {}  # signed-out session ids → their expiry
        self._lock = threading.Lock()

    def new(self, key_id: int | None) -> AdminSession:
        ttl = SIGNED_IN_TTL_S if key_id is not None else ANONYMOUS_TTL_S
        return AdminSession(secrets.token_urlsafe(24), key_id, int(time.time()) + ttl)

    def encode(self, session: AdminSession) -> str:
        body = _b64(json.dumps([session.sid, session.key_id, session.expires], separators=(",", ":")).encode())
        return f"{body}.{self._sign(body)}"

    def decode(self, cookie: str | None) -> AdminSession | None:
        if not cookie or cookie.count(".") != 1:
            return None
        body, mac = cookie.split(".")
        if not hmac.compare_digest(mac, self._sign(body)):
            return None
        try:
            sid, key_id, expires = json.loads(_unb64(body))
        except (ValueError, TypeError):
            return None
        if not isinstance(sid, str) or not isinstance(expires, int) or not (key_id is None or isinstance(key_id, int)):
            return None
        if expires < time.time() or sid in self._ended:
            return None
        return AdminSession(sid, key_id, expires)

    def csrf_token(self, session: AdminSession) -> str:
        return hmac.new(self._secret, b"csrf:" + session.sid.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, session: AdminSession, token: str | None) -> bool:
        return token is not None and token != "" and hmac.compare_digest(token.encode(), self.csrf_token(session).encode())

    def end(self, session: AdminSession) -> None:
        now = time.time()
        with self._lock:
            self._ended = {sid: exp for sid, exp in self._ended.items() if exp > now}
            self._ended[session.sid] = session.expires

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())
