"""Credits as integers: one credit is MICRO micro-credits, and every amount the system stores,
bills or compares is an int of micro-credits (never a float). Users write credits as decimal
text ("12", "0.25"); `parse_credits` reads it exactly and `format_credits` writes it back."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

MICRO = 1_000_000  # micro-credits per credit
# The largest amount anyone may name: a billion credits (far below int64 in micro-credits).
MAX_CREDITS = 10**9


def parse_credits(text: str, what: str = "amount", *, allow_zero: bool = True) -> int:
    """Micro-credits of a decimal number of credits, exactly. ValueError, naming ``what``, for
    text that is not a plain decimal number, negative, not finite, finer than a micro-credit,
    above MAX_CREDITS, or (``allow_zero`` False) zero."""
    raw = str(text).strip()
    try:
        value = Decimal(raw)
    except InvalidOperation:
        raise ValueError(f"{what} must be a number of credits, got {text!r}") from None
    if not value.is_finite():
        raise ValueError(f"{what} must be a finite number of credits, got {text!r}")
    if value < 0:
        raise ValueError(f"{what} must not be negative, got {text!r}")
    if value > MAX_CREDITS:
        raise ValueError(f"{what} must be at most {MAX_CREDITS} credits, got {text!r}")
    micro = value * MICRO
    if micro != micro.to_integral_value():
        raise ValueError(f"{what} has more than 6 decimals (a micro-credit), got {text!r}")
    if micro == 0 and not allow_zero:
        raise ValueError(f"{what} must be more than 0 credits")
    return int(micro)


def format_credits(micro: int) -> str:
    """``micro`` micro-credits as decimal credits, without trailing zeros ("12.5", "-3")."""
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(int(micro)), MICRO)
    if not frac:
        return f"{sign}{whole}"
    return f"{sign}{whole}.{frac:06d}".rstrip("0")
