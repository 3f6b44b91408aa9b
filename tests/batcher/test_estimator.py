"""The predictive mode's output-length estimate."""

import random
import statistics

import pytest
from weightq.batcher import OutputLengthEstimator


def _brute(lengths: list[int], max_new: int, generated: int) -> tuple[float, float]:
    """Mean and variance of min(length, max_new) - generated over the lengths past `generated`."""
    rest = [min(n, max_new) - generated for n in lengths if n > generated]
    return statistics.fmean(rest), statistics.pvariance(rest)


def test_worst_case_until_enough_requests_finished():
    est = OutputLengthEstimator(min_samples=10)
    for n in range(9):
        est.observe(10 + n)
    est.refresh([])
    assert est.reserve(500) == 500 and est.variance(500) == 0.0
    est.observe(19)
    est.refresh([])
    assert est.reserve(500) == 15  # the mean of 10..19 is 14.5: rounded up


@pytest.mark.parametrize("seed", range(5))
def test_moments_equal_brute_force_on_complete_data(seed):
    rng = random.Random(seed)
    lengths = [max(1, int(rng.lognormvariate(3.5, 1.1))) for _ in range(300)]
    est = OutputLengthEstimator(min_samples=1)
    for n in lengths:
        est.observe(n)
    est.refresh([])
    for max_new in (5, 40, max(lengths), max(lengths) + 100):
        for generated in (0, 3, 20, 60):
            if generated >= max_new or not any(n > generated for n in lengths):
                continue
            mean, var = est.moments(max_new, generated)
            want_mean, want_var = _brute(lengths, max_new, generated)
            assert mean == pytest.approx(want_mean, rel=1e-9)
            assert var == pytest.approx(want_var, rel=1e-6, abs=1e-6)


def test_reservation_is_conditional_on_tokens_already_generated():
    est = OutputLengthEstimator(min_samples=1)
    for n in range(1, 101):
        est.observe(n)
    est.refresh([])
    assert est.reserve(1000) == 51  # mean of 1..100 is 50.5
    assert est.reserve(1000, generated=80) == 91  # mean of 81..100 is 90.5
    assert est.reserve(1000, generated=100) == 1000  # beyond every observation: worst case
    assert est.reserve(40) == 33  # lengths past max_new_tokens count as it: the mean of min(n, 40) is 32.2
    assert est.variance(1000, generated=100) == 0.0


def test_running_requests_count_as_censored_so_early_finishers_do_not_bias_short():
    est = OutputLengthEstimator(min_samples=1)
    for _ in range(10):
        est.observe(5)  # ten short requests finished...
    est.refresh([])
    naive = est.reserve(1000)
    est.refresh([50] * 30)  # ...while thirty are still running past 50 tokens
    assert naive == 5
    # 3/4 of the mass lies past 50 with nothing observed beyond: it is expected to run to the cap
    assert est.reserve(1000) > 700


def test_window_forgets_old_lengths():
    est = OutputLengthEstimator(min_samples=1, window=4)
    for n in (100, 100, 100, 100, 1, 1, 1, 1):
        est.observe(n)
    est.refresh([])
    assert len(est) == 4 and est.reserve(1000) == 1


def test_the_margin_widens_after_preemptions_and_eases_back():
    est = OutputLengthEstimator(margin=0.5)
    est.tighten()
    est.tighten()
    assert est.margin == pytest.approx(1.0)
    for _ in range(2000):
        est.relax()
    assert est.margin == pytest.approx(0.5)
    for _ in range(100):
        est.tighten()
    assert est.margin == est.MAX_MARGIN
