import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.accounts import AccountError, create_key, create_tenant, hash_key, list_keys, list_tenants, revoke_key
from billing.models import ApiKey


def test_keys_are_stored_as_hashes(db):
    create_tenant(db, "acme", budget_usd=10.0)
    created = create_key(db, "acme", rpm=5, tpm=1000, budget_usd=1.5, project="search")
    assert created.key.startswith("tg-") and len(created.key) > 40
    with Session(db) as s:
        row = s.scalar(select(ApiKey))
        assert row.key_hash == hash_key(created.key)
        assert created.key not in (row.key_hash, row.prefix)
        assert row.prefix == created.key[:10] and (row.rpm, row.tpm, row.budget_usd) == (5, 1000, 1.5)
    [info] = list_keys(db)
    assert info.tenant == "acme" and not info.revoked and info.project == "search"
    assert [t.name for t in list_tenants(db)] == ["acme"]


def test_revoke_by_id_and_prefix(db):
    create_tenant(db, "acme")
    a = create_key(db, "acme")
    b = create_key(db, "acme")
    assert revoke_key(db, str(a.id)) == a.id
    assert revoke_key(db, b.prefix) == b.id
    assert all(k.revoked for k in list_keys(db))
    with pytest.raises(AccountError):
        revoke_key(db, "tg-nothere")


def test_account_errors(db):
    create_tenant(db, "acme")
    with pytest.raises(AccountError):
        create_tenant(db, "acme")
    with pytest.raises(AccountError):
        create_key(db, "nobody")
    with pytest.raises(AccountError):
        create_key(db, "acme", rpm=-1)
