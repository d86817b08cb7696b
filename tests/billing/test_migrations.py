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
