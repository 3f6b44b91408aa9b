"""The predictive mode's output-length estimate."""

from batcher import OutputLengthEstimator


def test_worst_case_until_enough_requests_finished():
    est = OutputLengthEstimator(quantile=0.9, min_samples=10)
    for n in range(9):
        est.observe(10 + n)
    est.refresh([])
    assert est.reserve(500) == 500
    est.observe(19)
    est.refresh([])
    assert est.reserve(500) == 18  # 90% of the ten lengths 10..19 are <= 18


def test_quantile_is_conditional_on_tokens_already_generated():
    est = OutputLengthEstimator(quantile=0.5, min_samples=1)
    for n in range(1, 101):
        est.observe(n)
    est.refresh([])
    assert est.reserve(1000) == 50
    assert est.reserve(1000, generated=80) == 90  # median of 81..100
    assert est.reserve(1000, generated=100) == 1000  # beyond every observation: worst case
    assert est.reserve(60, generated=0) == 50 and est.reserve(40) == 40  # capped by max_new_tokens


def test_running_requests_count_as_censored_so_early_finishers_do_not_bias_short():
    est = OutputLengthEstimator(quantile=0.5, min_samples=1)
    for _ in range(10):
        est.observe(5)  # ten short requests finished...
    est.refresh([])
    naive = est.reserve(1000)
    est.refresh([50] * 30)  # ...while thirty are still running past 50 tokens
    assert naive == 5
    assert est.reserve(1000) == 1000  # most of the mass lies beyond anything observed: reserve the max


def test_window_forgets_old_lengths():
    est = OutputLengthEstimator(quantile=0.5, min_samples=1, window=4)
    for n in (100, 100, 100, 100, 1, 1, 1, 1):
        est.observe(n)
    est.refresh([])
    assert len(est) == 4 and est.reserve(1000) == 1
