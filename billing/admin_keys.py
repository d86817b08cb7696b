"""Operators' admin keys: create and check. Like API keys they are stored only as SHA-256 hashes."""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from billing.accounts import hash_key
from billing.models import AdminKey

ADMIN_PREFIX = "tga-"
DISPLAY_CHARS = 11
ENV_KEY_ID = 0  # the id sessions carry for TOLLGATE_ADMIN_KEY, which has no row


@dataclass(frozen=True)
class CreatedAdminKey:
    id: int
    key: str  # shown once, never stored
    prefix: str


def create_admin_key(engine: Engine, name: str | None = None) -> CreatedAdminKey:
    key = ADMIN_PREFIX + secrets.token_urlsafe(32)
    prefix = key[:DISPLAY_CHARS]
    with Session(engine) as s, s.begin():
        row = AdminKey(key_hash=hash_key(key), prefix=prefix, name=name)
        s.add(row)
        s.flush()
        key_id = row.id
    return CreatedAdminKey(key_id, key, prefix)


def check_admin_key(engine: Engine, key: str, env_key: str | None = None) -> int | None:
    """The admin key's id (ENV_KEY_ID for the configured TOLLGATE_ADMIN_KEY), or None if it is not one."""
    if not key:
        return None
    if env_key and hmac.compare_digest(key.encode(), env_key.encode()):
        return ENV_KEY_ID
    with Session(engine) as s:
        row = s.execute(select(AdminKey.id, AdminKey.revoked).where(AdminKey.key_hash == hash_key(key))).first()
    return row.id if row is not None and not row.revoked else None


def admin_key_active(engine: Engine, key_id: int) -> bool:
    if key_id == ENV_KEY_ID:
        return True
    with Session(engine) as s:
        revoked = s.scalar(select(AdminKey.revoked).where(AdminKey.id == key_id))
    return revoked is False
