from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from billing.db import make_engine
from billing.migrate import downgrade, upgrade
from billing.models import Base


def test_migrations_match_models(db):
    with db.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, Base.metadata)
    assert diff == []


def test_downgrade_then_upgrade(db_url):
    downgrade(db_url, "base")
    engine = make_engine(db_url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    upgrade(db_url)
    engine = make_engine(db_url)
    assert set(Base.metadata.tables) <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_0004_turns_float_money_and_seconds_into_exact_units_and_back(tmp_path) -> None:
    from decimal import Decimal

    from sqlalchemy import create_engine, text

    from billing.migrate import downgrade, upgrade
    from tests.billing.dbutil import fresh_database

    with fresh_database(tmp_path, migrate=False) as url:
        upgrade(url, "0003")
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO tenants (id, uid, name, budget_usd, created_at) "
                              "VALUES (1, 'u1', 'acme', 12.34, CURRENT_TIMESTAMP)"))
            conn.execute(text("INSERT INTO model_deployments (id, name, spec, input_per_1m, output_per_1m, gpu_hour, "
                              "updated_at) VALUES (1, 'm', '{}', 0.15, 0.6, 2.5, CURRENT_TIMESTAMP)"))
            conn.execute(text("INSERT INTO replica_intervals (id, model, replica, start, busy_s, idle_s) "
                              "VALUES (1, 'm', 'r', CURRENT_TIMESTAMP, 0.25, 59.75)"))
        upgrade(url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT budget_usd FROM tenants")).scalar_one() == 12_340_000_000
            assert conn.execute(text("SELECT input_per_1m, output_per_1m, gpu_hour FROM model_deployments")
                                ).one() == (150_000_000, 600_000_000, 2_500_000_000)
            assert conn.execute(text("SELECT busy_s, idle_s FROM replica_intervals")).one() == (250_000, 59_750_000)
        downgrade(url, "0003")
        with engine.connect() as conn:
            assert Decimal(str(conn.execute(text("SELECT budget_usd FROM tenants")).scalar_one())) == Decimal("12.34")
            assert conn.execute(text("SELECT busy_s FROM replica_intervals")).scalar_one() == 0.25
        engine.dispose()


def test_0006_adds_end_user_and_tag_budgets_and_takes_them_back(tmp_path) -> None:
    from sqlalchemy import create_engine, text

    from billing.accounts import create_tenant
    from billing.scoped_budgets import list_budgets, set_budget
    from tests.billing.dbutil import fresh_database

    with fresh_database(tmp_path) as url:
        engine = create_engine(url)
        create_tenant(engine, "acme")
        set_budget(engine, "acme", user="alice", budget_usd=5, alert_at=0.8)
        set_budget(engine, "acme", tag="search", budget_usd=50)
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO spend_counters (scope, scope_id, period, spent_usd, reserved_usd) "
                              "VALUES ('key', 1, '2026-12', 0, 90000000)"))
            conn.execute(text("INSERT INTO budget_alerts (scope, scope_id, period, spent_usd, budget_usd, fired_at) "
                              "VALUES ('user', 1, '2026-12', 4, 5, CURRENT_TIMESTAMP)"))
            conn.execute(text("INSERT INTO reservations (request_id, owner, tenant_id, api_key_id, period, key_usd, "
                              "scoped_usd, scoped_holds, model, endpoint, created_at) VALUES ('r1', 'gw', 1, 1, "
                              "'2026-12', 90000000, 90000000, '[[\"user\", 1]]', 'm', 'chat', CURRENT_TIMESTAMP)"))
        downgrade(url, "0005")
        tables = inspect(engine)
        assert "scoped_budgets" not in tables.get_table_names()
        assert {"scoped_usd", "scoped_holds"}.isdisjoint(c["name"] for c in tables.get_columns("reservations"))
        with engine.connect() as conn:  # the key's hold stays; the end-user and tag counters and alerts go
            assert conn.execute(text("SELECT request_id, key_usd FROM reservations")).one() == ("r1", 90000000)
            assert conn.execute(text("SELECT DISTINCT scope FROM spend_counters")).scalars().all() == ["key"]
            assert conn.execute(text("SELECT count(*) FROM budget_alerts")).scalar_one() == 0
        upgrade(url)
        assert list_budgets(engine) == []
        set_budget(engine, "acme", user="alice", budget_usd=5)
        assert [(u.scope, u.name, u.budget_usd) for u in list_budgets(engine)] == [("user", "alice", 5)]
        engine.dispose()


def test_0009_keeps_the_prices_past_usage_was_charged_adapters_included(tmp_path) -> None:
    from sqlalchemy import create_engine, text

    from tests.billing.dbutil import fresh_database

    with fresh_database(tmp_path, migrate=False) as url:
        upgrade(url, "0008")
        engine = create_engine(url)
        spec = '{"name": "m", "adapters": [{"name": "legal", "source": "/a", "pricing": {"input_per_1m": 1.5}}]}'
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO model_deployments (id, name, spec, input_per_1m, output_per_1m, gpu_hour, "
                              "updated_at) VALUES (1, 'm', :spec, 150000000, 600000000, 2500000000, "
                              "CURRENT_TIMESTAMP)"), {"spec": spec})
            for rid, adapter in (("base", None), ("lora", "legal")):
                conn.execute(text("INSERT INTO usage_events (request_id, created_at, tags, model, adapter, endpoint, "
                                  "status, prompt_tokens, completion_tokens, cached_tokens, cache_hit, latency_s, "
                                  "cost_usd) VALUES (:r, CURRENT_TIMESTAMP, '[]', 'm', :a, 'completions', 'ok', 1, 1, "
                                  "0, false, 0, 0)"), {"r": rid, "a": adapter})
            conn.execute(text("INSERT INTO replica_intervals (id, model, replica, start, busy_s, idle_s) "
                              "VALUES (1, 'm', 'r', CURRENT_TIMESTAMP, 0, 60000000)"))
        upgrade(url)
        with engine.connect() as conn:
            prices = dict(conn.execute(text("SELECT request_id, input_per_1m || '/' || cached_input_per_1m || '/' || "
                                            "output_per_1m FROM usage_events")).all())
            assert prices == {"base": "150000000/150000000/600000000", "lora": "1500000000/1500000000/0"}
            assert conn.execute(text("SELECT gpu_hour FROM replica_intervals")).scalar_one() == 2_500_000_000
        engine.dispose()
