"""Argument checkers shared across dp_hf.

Every checker raises ``ValueError`` with a message that names the argument,
shows the offending value with ``repr`` and says how to fix it. Checkers that
accept a value return it normalised (``float`` or ``int``), so they can be used
inline: ``delta = check_delta(delta)``.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import reprlib
import warnings
from typing import Any

__all__ = [
    "parse_optimizer_kwargs",
    "check_dataset_size",
    "check_delta",
    "check_epsilon",
    "check_max_grad_norm",
    "check_noise_multiplier",
    "check_non_negative_finite",
    "check_non_negative_int",
    "check_positive_int",
    "check_sample_rate",
    "default_delta",
    "warn_if_delta_too_large",
]

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60


def _as_real(name: str, value: Any, fix: str) -> float:
    """``float(value)`` for a real number (bools rejected); otherwise ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if isinstance(value, str) and _parses_as_float(value):
            fix = (
                f"It is the string {_short.repr(value)} (YAML reads 1e-5, without a dot, as text; so are values "
                f"from environment variables): pass the number {float(value)!r} (in YAML, write 1.0e-5)."
            )
        raise ValueError(f"{name} must be a real number, got {_short.repr(value)}. {fix}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}. {fix}")
    return value


def _parses_as_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _as_int(name: str, value: Any, fix: str) -> int:
    """``int(value)`` for an integer (Python or NumPy; bools rejected); otherwise ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}. {fix}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {_short.repr(value)}. {fix}") from None


def check_epsilon(epsilon: Any, name: str = "epsilon") -> float:
    """Check a privacy budget: ``0 < epsilon < inf``."""
    fix = "Pass a finite privacy budget such as 1.0 or 8.0."
    value = _as_real(name, epsilon, fix)
    if not (0.0 < value < math.inf):
        raise ValueError(f"{name} must be positive and finite, got {epsilon!r}. {fix}")
    return value


def check_delta(delta: Any, name: str = "delta") -> float:
    """Check a failure probability: ``0 < delta < 1``."""
    fix = "Pick delta well below 1/n for n training examples, e.g. 1e-5 for n = 60,000."
    value = _as_real(name, delta, fix)
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must satisfy 0 < {name} < 1, got {delta!r}. {fix}")
    return value


def check_sample_rate(sample_rate: Any, name: str = "sample_rate") -> float:
    """Check a Poisson sampling rate: ``0 < q <= 1`` (q = expected batch size / dataset size)."""
    fix = "Use q = expected batch size / dataset size, e.g. 256 / 60000."
    value = _as_real(name, sample_rate, fix)
    if not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must satisfy 0 < {name} <= 1, got {sample_rate!r}. {fix}")
    return value


def check_noise_multiplier(noise_multiplier: Any, name: str = "noise_multiplier") -> float:
    """Check a noise multiplier: ``0 <= sigma < inf`` (sigma = 0 means no privacy)."""
    fix = "The noise std is sigma * C; use sigma >= 0, typically 0.5 to 2."
    value = _as_real(name, noise_multiplier, fix)
    if not (0.0 <= value < math.inf):
        raise ValueError(f"{name} must be non-negative and finite, got {noise_multiplier!r}. {fix}")
    return value


#: The smallest clipping norm: below it, roundings under float32's and bf16's normal range (the
#: book-keeping split's ``f x`` loses up to ``2^-134`` per entry there, whatever its relative bound) are
#: no longer negligible against ``C``, and each contribution's bound ``<= C`` is not shown.
MIN_MAX_GRAD_NORM = 2.0**-64


def check_max_grad_norm(max_grad_norm: Any, name: str = "max_grad_norm") -> float:
    """Check a clipping norm: ``C >= 2^-64`` (:data:`MIN_MAX_GRAD_NORM`); ``float('inf')`` means no clipping."""
    fix = "Use a positive clipping norm such as 1.0, or float('inf') for no clipping."
    value = _as_real(name, max_grad_norm, fix)
    if not value > 0.0:
        raise ValueError(f"{name} must be positive, got {max_grad_norm!r}. {fix}")
    if value < MIN_MAX_GRAD_NORM:
        raise ValueError(
            f"{name} = {max_grad_norm!r} is below 2^-64 ({MIN_MAX_GRAD_NORM:.3g}), where the clipping "
            "arithmetic's roundings below the float32 range are not negligible against it. Scale the loss "
            "up instead (the gradients and a useful clip norm scale with it)."
        )
    return value


def check_positive_finite(name: str, value: Any, meaning: str = "") -> float:
    """Check a finite real ``> 0`` (stability constants, clamps); ``meaning`` says what it is."""
    return _finite_from(name, value, meaning, zero_allowed=False)


def check_non_negative_finite(name: str, value: Any, meaning: str = "") -> float:
    """Check a finite real ``>= 0`` (a learning rate); ``meaning`` says what it is."""
    return _finite_from(name, value, meaning, zero_allowed=True)


def _finite_from(name: str, value: Any, meaning: str, zero_allowed: bool) -> float:
    what = f"{name} ({meaning})" if meaning else name
    bound = ">= 0" if zero_allowed else "> 0"
    fix = f"Pass a finite number {bound} for {name}."
    number = _as_real(what, value, fix)
    if not ((number >= 0.0 if zero_allowed else number > 0.0) and math.isfinite(number)):
        raise ValueError(f"{what} must be a finite number {bound}, got {value!r}. {fix}")
    return number


def check_positive_int(name: str, value: Any) -> int:
    """Check an integer ``>= 1`` (steps, batch sizes, dataset sizes...)."""
    fix = f"Pass a whole number >= 1 for {name}."
    number = _as_int(name, value, fix)
    if number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}. {fix}")
    return number


def check_non_negative_int(name: str, value: Any) -> int:
    """Check an integer ``>= 0``."""
    fix = f"Pass a whole number >= 0 for {name}."
    number = _as_int(name, value, fix)
    if number < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}. {fix}")
    return number


def check_dataset_size(dataset: Any) -> int:
    """Return ``len(dataset)``, refusing datasets of unknown or zero length.

    Poisson sampling draws each example independently with probability
    ``q = B / n`` and the accountant needs that ``n``, so streaming datasets
    (``IterableDataset``) cannot be used.
    """
    try:
        size = len(dataset)
    except TypeError:
        raise ValueError(
            f"dataset must have a known length, got {_short.repr(dataset)} "
            f"(type {type(dataset).__name__}) which has no __len__. Poisson sampling draws every "
            "example independently with probability q = batch_size / n and the privacy accounting "
            "needs n, so streaming/iterable datasets cannot be used. Load a map-style dataset "
            "instead: a datasets.Dataset (not datasets.IterableDataset; e.g. load_dataset(..., "
            "streaming=False)) or a torch.utils.data.Dataset with __len__ and __getitem__."
        ) from None
    if size < 1:
        raise ValueError(
            f"dataset must not be empty, got {_short.repr(dataset)} with length {size!r}. "
            "Pass a dataset with at least one example."
        )
    return int(size)


def default_delta(dataset_size: int) -> float:
    """Default delta for ``n`` examples: ``1 / (10 n)`` rounded *down* to one significant digit.

    Examples: n = 60,000 -> 1e-6 (1/600,000 = 1.67e-6); n = 50,000 -> 2e-6;
    n = 1,000 -> 1e-4. The result is always ``<= 1/(10 n) < 1/n``.
    """
    n = check_positive_int("dataset_size", dataset_size)
    mantissa, exponent = f"{1.0 / (10 * n):.15e}".split("e")
    return float(f"{mantissa[0]}e{exponent}")


def warn_if_delta_too_large(delta: float, dataset_size: int) -> None:
    """Emit a ``UserWarning`` when ``delta >= 1/n``.

    With ``delta >= 1/n`` the mechanism "release one random example in the
    clear" is (0, delta)-DP, so such a guarantee is nearly meaningless.
    """
    n = check_positive_int("dataset_size", dataset_size)
    if delta >= 1.0 / n:
        warnings.warn(
            f"delta = {delta!r} is >= 1/n = {1.0 / n:.3g} for n = {n} examples: a guarantee that "
            "allows leaking one whole example is nearly meaningless. Choose delta well below 1/n, "
            f"e.g. 1/(10 n) = {1.0 / (10 * n):.3g} or 1/n^1.1 = {n**-1.1:.3g} "
            f"(default_delta(n) gives {default_delta(n):g}).",
            UserWarning,
            stacklevel=2,
        )


def parse_optimizer_kwargs(value: Any) -> dict[str, Any]:
    """``dp_optimizer_kwargs`` as a dict (a JSON string from the command line or a YAML file), or a clear error."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"dp_optimizer_kwargs={value!r} is not valid JSON ({error}); pass a JSON object, e.g. "
                "'{\"momentum\": 0.9}' for dp-sgd."
            ) from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(
            f"dp_optimizer_kwargs={value!r} must be a dict (a JSON object) of optimizer options."
        )
    return dict(value or {})
