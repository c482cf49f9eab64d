from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pytest

from dp_hf import validation

LEARNING_RATE = functools.partial(validation.check_non_negative_finite, "learning_rate")

# (checker, good value, normalised result)
GOOD = [
    (validation.check_epsilon, 1, 1.0),
    (validation.check_epsilon, np.float32(0.5), 0.5),
    (validation.check_delta, 1e-5, 1e-5),
    (validation.check_sample_rate, 1, 1.0),
    (validation.check_sample_rate, 256 / 60000, 256 / 60000),
    (validation.check_noise_multiplier, 0, 0.0),
    (validation.check_noise_multiplier, 1.1, 1.1),
    (validation.check_max_grad_norm, 1.0, 1.0),
    (validation.check_max_grad_norm, math.inf, math.inf),
    (validation.check_max_grad_norm, 1e-19, 1e-19),
    (LEARNING_RATE, 0, 0.0),
    (LEARNING_RATE, 1e-3, 1e-3),
]

# (checker, bad value, argument name expected in the message)
BAD = [
    (validation.check_epsilon, 0.0, "epsilon"),
    (validation.check_epsilon, -1.0, "epsilon"),
    (validation.check_epsilon, math.inf, "epsilon"),
    (validation.check_epsilon, math.nan, "epsilon"),
    (validation.check_epsilon, "1.0", "epsilon"),
    (validation.check_epsilon, True, "epsilon"),
    (validation.check_delta, 0.0, "delta"),
    (validation.check_delta, 1.0, "delta"),
    (validation.check_delta, -1e-5, "delta"),
    (validation.check_delta, None, "delta"),
    (validation.check_sample_rate, 0.0, "sample_rate"),
    (validation.check_sample_rate, 1.5, "sample_rate"),
    (validation.check_sample_rate, math.nan, "sample_rate"),
    (validation.check_noise_multiplier, -0.1, "noise_multiplier"),
    (validation.check_noise_multiplier, math.inf, "noise_multiplier"),
    (validation.check_max_grad_norm, 0.0, "max_grad_norm"),
    (validation.check_max_grad_norm, -1.0, "max_grad_norm"),
    (validation.check_max_grad_norm, math.nan, "max_grad_norm"),
    (validation.check_max_grad_norm, 1e-30, "max_grad_norm = 1e-30 is below 2^-64"),
    (LEARNING_RATE, -1e-3, "learning_rate"),
    (LEARNING_RATE, math.inf, "learning_rate"),
    (LEARNING_RATE, "1e-3", "learning_rate"),
]


@pytest.mark.parametrize(("check", "value", "expected"), GOOD)
def test_good_values_are_returned_as_float(check, value, expected):
    result = check(value)
    assert result == expected
    assert type(result) is float


@pytest.mark.parametrize(("check", "value", "name"), BAD)
def test_bad_values_raise_with_name_and_repr(check, value, name):
    with pytest.raises(ValueError) as info:
        check(value)
    message = str(info.value)
    assert message.startswith(name)
    assert repr(value) in message


@pytest.mark.parametrize("text", ["1e-5", "8"])
def test_a_number_given_as_text_is_named_as_such(text):
    # YAML reads 1e-5 (no dot) as a string: the message suggested 1e-5, the value the user had written.
    with pytest.raises(ValueError, match=rf"It is the string '{text}' .*pass the number {float(text)!r}"):
        validation.check_delta(text)


def test_learning_rate_given_as_text_is_refused_when_the_arguments_are_built(tmp_path):
    # It was accepted and failed only when train() built the optimizer.
    from dp_hf import DPTrainingArguments

    with pytest.raises(ValueError, match=r"learning_rate .* got '1e-3'\. It is the string '1e-3'"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, learning_rate="1e-3")


def test_custom_name_appears_in_message():
    with pytest.raises(ValueError, match=r"^--delta must satisfy 0 < --delta < 1, got 2\.0"):
        validation.check_delta(2.0, "--delta")


@pytest.mark.parametrize("value", [1, 7, np.int64(3)])
def test_positive_int_accepts_integers(value):
    assert validation.check_positive_int("steps", value) == int(value)
    assert type(validation.check_positive_int("steps", value)) is int


@pytest.mark.parametrize("value", [0, -3, 1.5, 2.0, "3", True, None])
def test_positive_int_rejects(value):
    with pytest.raises(ValueError, match=r"^steps must be") as info:
        validation.check_positive_int("steps", value)
    assert repr(value) in str(info.value)


def test_non_negative_int():
    assert validation.check_non_negative_int("steps", 0) == 0
    with pytest.raises(ValueError, match=r"steps must be a non-negative integer, got -1"):
        validation.check_non_negative_int("steps", -1)


class _Stream:
    """A dataset without __len__, like datasets.IterableDataset or torch IterableDataset."""

    def __iter__(self):
        yield from range(3)


def test_dataset_size_of_map_style_dataset():
    assert validation.check_dataset_size(list(range(17))) == 17


def test_dataset_size_of_iterable_dataset_explains_poisson_sampling():
    with pytest.raises(ValueError) as info:
        validation.check_dataset_size(_Stream())
    message = str(info.value)
    for needed in ("_Stream", "__len__", "Poisson", "datasets.Dataset", "map-style"):
        assert needed in message


def test_dataset_size_of_empty_dataset():
    with pytest.raises(ValueError, match="must not be empty"):
        validation.check_dataset_size([])


@pytest.mark.parametrize(
    ("dataset_size", "expected"),
    [(60_000, 1e-6), (50_000, 2e-6), (1_000, 1e-4), (3, 0.03), (1, 0.1), (25_000, 4e-6)],
)
def test_default_delta_examples(dataset_size, expected):
    assert validation.default_delta(dataset_size) == expected


def test_default_delta_is_between_1_over_20n_and_1_over_10n():
    for n in [*range(1, 2000, 7), 12_345, 60_000, 67_349, 10**6, 3 * 10**7]:
        delta = validation.default_delta(n)
        assert 1 / (20 * n) < delta <= 1 / (10 * n) < 1 / n, n


def test_default_delta_rejects_bad_size():
    with pytest.raises(ValueError, match="dataset_size must be a positive integer, got 0"):
        validation.default_delta(0)


@pytest.mark.parametrize(("delta", "n"), [(1e-3, 1000), (0.01, 1000), (1e-5, 100_000)])
def test_warns_when_delta_is_at_least_1_over_n(delta, n):
    with pytest.warns(UserWarning, match=r"well below 1/n") as record:
        validation.warn_if_delta_too_large(delta, n)
    assert repr(delta) in str(record[0].message)


def test_no_warning_for_small_delta():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validation.warn_if_delta_too_large(1e-5, 60_000)
