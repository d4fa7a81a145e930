"""The measures a reduced-precision plan is held to (``fxforge.core.accuracy``), against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fxforge.core.accuracy import Agreement, Tolerance, agreement


def test_relative_error_is_normwise_and_cosine_is_of_the_flattened_outputs():
    reference = torch.tensor([10.0, -5.0, 0.001])
    candidate = torch.tensor([10.1, -5.0, 0.002])  # the tiny element is 100 % off: normwise it counts for little
    found = agreement([reference], [candidate])
    assert found.relative_error == pytest.approx(0.1 / 10.0, rel=1e-5)  # (10.1 in float32)
    expected_cosine = float(reference.double() @ candidate.double() / (reference.double().norm() * candidate.double().norm()))
    assert found.cosine == pytest.approx(expected_cosine) and found.top1 is None


def test_top1_agreement_is_measured_on_class_scores_only():
    scores = torch.tensor([[0.1, 0.9, 0.0], [0.5, 0.4, 0.1], [0.0, 0.0, 1.0], [0.3, 0.2, 0.25]])
    flipped = scores.clone()
    flipped[1] = torch.tensor([0.4, 0.5, 0.1])  # one row of four changes its class
    found = agreement([(scores, torch.ones(4))], [(flipped, torch.ones(4))])
    assert found.top1 == 0.75
    assert Tolerance(relative_error=1.0, cosine=0.9).refusal(found) == "top-1 agreement 75.0% below 99%"


def test_the_worst_output_and_call_count():
    calls = [torch.ones(3), torch.ones(3) * 2]
    found = agreement(calls, [calls[0] * 1.01, calls[1] * 1.2])
    assert found.relative_error == pytest.approx(0.2)


def test_nan_where_the_reference_has_none_breaks_any_tolerance():
    found = agreement([torch.ones(3)], [torch.tensor([1.0, math.nan, 1.0])])
    assert math.isnan(found.relative_error)
    assert Tolerance(relative_error=10.0).refusal(found).startswith("relative error nan")
    same = agreement([torch.tensor([1.0, math.nan])], [torch.tensor([1.0, math.nan])])
    assert same == Agreement(0.0, 1.0, None)


def test_integer_outputs_are_not_measured_and_empty_ones_agree():
    assert agreement([(torch.arange(3), torch.empty(0))], [(torch.arange(3) + 1, torch.empty(0))]) == \
        Agreement(0.0, 1.0, None)


@pytest.mark.parametrize("bad", [0, -0.1, "0.1", True])
def test_a_tolerance_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError, match="expected a positive number"):
        Tolerance.of(bad)


def _noisy_scores(rows: int, classes: int, noise: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    reference = torch.randn(rows, classes, generator=generator)
    return reference, reference + noise * torch.randn(rows, classes, generator=generator)


def test_the_expected_top1_agreement_tracks_the_flip_rate_on_rows_never_checked():
    reference, candidate = _noisy_scores(20000, 100, 0.02)
    actual = float((reference.argmax(1) == candidate.argmax(1)).double().mean())
    expected = [agreement([reference[k:k + 40]], [candidate[k:k + 40]]).top1_expected for k in range(0, 400, 40)]
    assert 0.95 < actual < 0.99
    assert abs(sum(expected) / len(expected) - actual) < 0.01
    exact = agreement([reference[:40]], [reference[:40].clone()])
    assert exact.top1 == exact.top1_expected == 1.0


def test_a_flip_rate_forty_rows_do_not_show_is_refused_by_the_margins():
    reference, candidate = _noisy_scores(20000, 100, 0.02)
    # Some 40 rows with no flip among them, while about 3 % of all rows flip.
    start = next(k for k in range(0, 20000, 40)
                 if bool((reference[k:k + 40].argmax(1) == candidate[k:k + 40].argmax(1)).all()))
    found = agreement([reference[start:start + 40]], [candidate[start:start + 40]])
    assert found.top1 == 1.0
    assert found.top1_expected < 0.99
    assert Tolerance().refusal(found).startswith("top-1 agreement expected from the score margins")
    assert Tolerance(top1=None).refusal(found) is None
    assert "expected from the margins" in found.describe()


def test_features_get_no_expected_top1_and_nan_rows_are_left_out_of_it():
    reference, candidate = _noisy_scores(40, 10, 0.0)
    assert agreement([{"pooler_output": reference}], [{"pooler_output": candidate}]).top1_expected is None
    reference[0, 0] = candidate[0, 0] = math.nan
    assert agreement([reference], [candidate]).top1_expected == 1.0
