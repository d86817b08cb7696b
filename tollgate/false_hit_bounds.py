"""The semantic cache's false-hit bounds a tenant or key may choose (δ: the most a share of non-duplicate questions
may be served a cached answer). Here, below both cache/ (which calibrates a threshold for each) and billing/ (which
stores a tenant's or key's choice)."""

OFFERED = (0.002, 0.005, 0.01, 0.02, 0.05)
DEFAULT = 0.01


def offered_text() -> str:
    return ", ".join(f"{d:g}" for d in OFFERED)


def is_offered(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and any(
        abs(float(value) - d) < 1e-12 for d in OFFERED)
