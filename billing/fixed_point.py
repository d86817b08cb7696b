"""Exact decimal columns: a Decimal in Python, a whole number of units (BIGINT) in SQL, so that sums and
comparisons are exact on SQLite and PostgreSQL alike. Money (billing/money.py) counts nano-dollars;
GPU time (billing/models.py) counts microseconds."""

from __future__ import annotations

import math
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import Any

from sqlalchemy import BigInteger
from sqlalchemy.sql import operators
from sqlalchemy.types import TypeDecorator


def exact(value: Any, places: int) -> Decimal:
    """A Decimal from an int, float, str or Decimal, rounded half-even to `places` decimals. A float is
    read by its shortest repr (0.1 is exactly 0.1), never by its binary expansion."""
    if isinstance(value, bool):
        raise TypeError("an amount cannot be a bool")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"an amount must be finite, got {value!r}")
        value = repr(value)
    try:
        amount = Decimal(value)
    except (InvalidOperation, TypeError, ValueError):
        raise ValueError(f"not an amount: {value!r}") from None
    if not amount.is_finite():
        raise ValueError(f"an amount must be finite, got {value!r}")
    return amount.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_EVEN)


class FixedPoint(TypeDecorator[Decimal]):
    """Binds int / float / str / Decimal, stores whole units of 10**-places, reads Decimal. A sum or difference
    of two such columns (or of one and a Python amount) keeps the type, so amounts bound into it are scaled
    too: `spent + reserved + :cost <= :budget` compares units with units."""

    impl = BigInteger
    cache_ok = True

    class comparator_factory(TypeDecorator.Comparator):  # noqa: N801 - the name SQLAlchemy looks up
        def _adapt_expression(self, op: Any, other_comparator: Any) -> Any:
            other = other_comparator.type
            if (op in (operators.add, operators.sub) and isinstance(other, FixedPoint)
                    and other.places == self.type.places):
                return op, self.type
            return super()._adapt_expression(op, other_comparator)

    def __init__(self, places: int) -> None:
        super().__init__()
        self.places = places

    def process_bind_param(self, value: Any, dialect: Any) -> int | None:
        return None if value is None else int(exact(value, self.places).scaleb(self.places))

    def process_result_value(self, value: Any, dialect: Any) -> Decimal | None:
        # SUM over BIGINT comes back as NUMERIC on PostgreSQL: a whole Decimal, still a count of units
        return None if value is None else Decimal(int(value)).scaleb(-self.places)

    def coerce_compared_value(self, op: Any, value: Any) -> "FixedPoint":
        return self  # `spent + :amount <= budget`: the Python amount binds in units too

    @property
    def python_type(self) -> type:
        return Decimal


class Seconds(FixedPoint):
    """A duration column: whole microseconds in SQL, Decimal seconds in Python."""

    cache_ok = True

    def __init__(self) -> None:
        super().__init__(6)
