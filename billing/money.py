"""Money as people read it: dollars with the precision the amount has, never a sub-cent amount
shown as "$0.00"."""

from __future__ import annotations


def usd(amount: float) -> str:
    """$5.00, $4.9012, $0.000123; amounts under a millionth in scientific notation ($1.23e-08)."""
    if amount != 0 and abs(amount) < 1e-6:
        return f"${amount:.2e}"
    text = f"{amount:,.6f}".rstrip("0")
    whole, _, cents = text.partition(".")
    return f"${whole}.{cents.ljust(2, '0')}"
