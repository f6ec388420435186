"""The range checks every component's ``Config.validate()`` repeats, with one wording: a
ValueError that names the key, the value and what is allowed (the pre-flight turns it into
the run's one error)."""

from __future__ import annotations


def require_positive(key: str, value, what: str = "a positive number") -> None:
    """``value`` is a number above 0 (not a bool: ``True > 0``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{key} is {value!r}; it must be {what}.")


def require_at_least_zero(key: str, value) -> None:
    if value < 0:
        raise ValueError(f"{key} is {value!r}; it must be >= 0.")
