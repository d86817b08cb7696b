"""`platform admin create-key` through a parser built here with gateway.cli.admin.register."""

from __future__ import annotations

import argparse

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.accounts import hash_key
from billing.admin_keys import ENV_KEY_ID, check_admin_key
from billing.db import make_engine
from billing.models import AdminKey
from gateway.cli.admin import register
from gateway.settings import Settings


def test_create_key_prints_it_once_and_stores_only_its_hash(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"  # not migrated: the command upgrades the database itself
    parser = argparse.ArgumentParser(prog="platform")
    register(parser.add_subparsers(required=True))
    args = parser.parse_args(["admin", "create-key", "--name", "ops"])
    assert args.func(args, Settings(home=tmp_path, database_url=url)) == 0
    out = capsys.readouterr()
    key = out.out.strip()
    assert key.startswith("tga-") and len(key) > 40 and key not in out.err

    engine = make_engine(url)
    try:
        with Session(engine) as s:
            row = s.scalars(select(AdminKey)).one()
        assert row.key_hash == hash_key(key) and row.name == "ops" and key[:11] == row.prefix
        assert key not in (row.key_hash, row.prefix)
        assert check_admin_key(engine, key) == row.id
        assert check_admin_key(engine, key + "x") is None
        assert check_admin_key(engine, "tg-env-secret", env_key="tg-env-secret") == ENV_KEY_ID
    finally:
        engine.dispose()
