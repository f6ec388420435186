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


def require_steps_or_fraction(key: str, value) -> None:
    """``value`` is a count of steps (a positive whole number) or a fraction of the run in (0, 1),
    as Hugging Face's and Transformer Lab's ``eval_steps`` / ``save_steps`` / ``logging_steps``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or not (value < 1 or float(value).is_integer())
    ):
        raise ValueError(
            f"{key} is {value!r}; give a whole number of steps (e.g. 50) or a fraction of "
            "training.steps between 0 and 1 (e.g. 0.1: every tenth of the run)."
        )


def is_fraction(value) -> bool:
    """A steps-or-fraction setting that is a fraction of the run."""
    return isinstance(value, float) and 0 < value < 1


def steps_of(value: int | float, total: int, multiple: int = 1) -> int:
    """``value`` in steps: a fraction of ``total`` to the nearest multiple of ``multiple`` (at
    least one), a count as it is."""
    if not is_fraction(value):
        return int(value)
    return max(1, round(value * total / multiple)) * multiple
