"""The admission writer commits a burst's reservations and shrinks together on SQLite, with each reservation still
checked against the ones before it: a budget's edge holds exactly, a refusal inside a batch gives back what it took,
and a batch that fails is run again one operation at a time so each caller gets its own outcome."""

import threading
from concurrent.futures import wait
from decimal import Decimal

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from billing.accounts import create_key, create_tenant
from billing.admission_writer import AdmissionWriter
from billing.models import Reservation, SpendCounter
from billing.reservations import Admitted, Budgets, Refusal, Worst

NOW = 1_800_000_010.0
COST = Decimal("0.001")


@pytest.fixture
def budgets(db):
    tenant = create_tenant(db, "acme", budget_usd=Decimal("1"))
    key = create_key(db, "acme", budget_usd=Decimal("0.007"), rpm=1000)
    return Budgets(tenant.id, key.id, Decimal("0.007"), Decimal("1"), 1000, None)


def _counters(db) -> dict[str, tuple[Decimal, Decimal]]:
    with db.connect() as conn:
        return {r.scope: (r.spent_usd, r.reserved_usd) for r in conn.execute(select(SpendCounter))}


def _holds(db) -> int:
    with db.connect() as conn:
        return len(conn.execute(select(Reservation.request_id)).all())


def _burst(writer: AdmissionWriter, budgets: Budgets, n: int, prefix: str = "r") -> list:
    go = threading.Event()
    futures: list = []

    def submit() -> None:
        go.wait()
        futures.extend(writer.reserve(f"{prefix}{i}", "gw", budgets, Worst(COST, 10), model="m", endpoint="chat",
                                      now=NOW) for i in range(n))

    t = threading.Thread(target=submit)
    t.start()
    go.set()
    t.join()
    wait(futures, 30)
    return [f.result() for f in futures]


def test_a_burst_at_the_budget_edge_admits_exactly_what_fits_in_few_transactions(db, budgets):
    writer = AdmissionWriter(db)
    results = _burst(writer, budgets, 60)
    admitted = [r for r in results if isinstance(r, Admitted)]
    refused = [r for r in results if isinstance(r, Refusal)]
    assert len(admitted) == 7 and len(refused) == 53  # $0.007 key budget, $0.001 each
    assert all(r.scope == "key" for r in refused)
    # the refused ones took the tenant's counter before the key's refused them, and gave it back
    assert _counters(db) == {"tenant": (0, 7 * COST), "key": (0, 7 * COST)}
    assert _holds(db) == 7
    assert writer.batches < 60 / 4
    writer.close()


def test_shrinks_in_one_batch_leave_each_hold_at_what_it_used(db, budgets):
    writer = AdmissionWriter(db)
    _burst(writer, budgets, 5)
    used = {f"r{i}": Decimal("0.0001") * (i + 1) for i in range(5)}
    futures = [writer.shrink(rid, cost, 1) for rid, cost in used.items()] + [writer.shrink("nobody", COST, 1)]
    assert [f.result(30) for f in futures] == [True] * 5 + [False]
    assert _counters(db) == {"tenant": (0, sum(used.values())), "key": (0, sum(used.values()))}
    with db.connect() as conn:
        held = dict(conn.execute(select(Reservation.request_id, Reservation.key_usd)).all())
    assert held == used
    # room came back: two more fit under the key's $0.007 now that five hold $0.0015
    assert sum(isinstance(r, Admitted) for r in _burst(writer, budgets, 8, prefix="again")) == 5
    writer.close()


def test_a_failing_batch_runs_each_operation_alone(db, budgets):
    writer = AdmissionWriter(db)
    blocker = threading.Lock()
    blocker.acquire()
    original = writer._write

    def held_write(batch):  # the first batch waits, so both duplicates land in the second
        with blocker:
            pass
        original(batch)

    writer._write = held_write
    first = writer.reserve("dup-0", "gw", budgets, Worst(COST, 10), model="m", endpoint="chat", now=NOW)
    same = [writer.reserve("dup", "gw", budgets, Worst(COST, 10), model="m", endpoint="chat", now=NOW)
            for _ in range(2)]
    blocker.release()
    assert isinstance(first.result(30), Admitted)
    outcomes = [f.exception(30) or f.result() for f in same]
    assert isinstance(outcomes[0], Admitted) and isinstance(outcomes[1], IntegrityError)
    assert _counters(db) == {"tenant": (0, 2 * COST), "key": (0, 2 * COST)}
    assert _holds(db) == 2
    writer.close()


def test_only_sqlite_uses_it(db):
    assert AdmissionWriter.wanted(db) == (db.dialect.name == "sqlite")


def test_an_unreachable_database_fails_the_whole_batch_at_once(db, budgets, monkeypatch):
    """Injected fault: the database answers every statement with an OperationalError. Each caller gets it once,
    without the batch being tried again one operation at a time (each try would wait out the busy timeout)."""
    import billing.admission_writer as writer_module
    from sqlalchemy.exc import OperationalError

    calls = []

    def unreachable(*args, **kwargs):
        calls.append(1)
        raise OperationalError("INSERT", {}, Exception("database is locked"))

    monkeypatch.setattr(writer_module, "reserve_in", unreachable)
    monkeypatch.setattr(writer_module, "reserve", unreachable)
    writer = AdmissionWriter(db)
    futures = [writer.reserve(f"r{i}", "gw", budgets, Worst(COST, 10), model="m", endpoint="chat", now=NOW)
               for i in range(5)]
    assert all(isinstance(f.exception(30), OperationalError) for f in futures)
    assert len(calls) <= 5  # one try each at most, in the batches they fell into: none again alone
    assert _holds(db) == 0
    writer.close()
