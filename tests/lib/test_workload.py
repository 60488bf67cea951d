"""lib.workload: the synthetic serving workload is seeded, follows its stated distribution and
refuses bad input clearly."""

import pytest

from lib.workload import Request, make_workload


def test_workload_is_seeded_and_respects_max_len():
    a = make_workload(300, seed=4, max_len=128, prompt_mean=60, output_mean=60)
    assert a == make_workload(300, seed=4, max_len=128, prompt_mean=60, output_mean=60)
    assert a != make_workload(300, seed=5, max_len=128, prompt_mean=60, output_mean=60)
    assert [r.rid for r in a] == list(range(300))
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= 128 for r in a)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)


def test_workload_follows_its_stated_distribution():
    n = 4000
    reqs = make_workload(n, seed=0, arrival_rate=0.5, prompt_mean=50, output_mean=120, max_len=10**6)  # no cut
    # Geometric with mean m has standard deviation sqrt(m(m-1)) < m, so the mean of 4000 draws is
    # within m/sqrt(4000) ~ 1.6% (one sigma) of m: 6% is beyond 3.5 sigma. The same holds for the
    # mean exponential gap 1/rate.
    for got, want in (
        (sum(r.prompt_len for r in reqs) / n, 50),
        (sum(r.output_len for r in reqs) / n, 120),
        (reqs[-1].arrival / n, 1 / 0.5),
    ):
        assert abs(got - want) / want < 0.06
    assert min(r.output_len for r in reqs) == 1 and sum(r.output_len == 1 for r in reqs) > n / 120 / 2  # P(1) = 1/m


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"n_requests": 0}, ValueError, "n_requests"),
        ({"arrival_rate": 0}, ValueError, "arrival_rate"),
        ({"arrival_rate": float("inf")}, ValueError, "arrival_rate"),
        ({"prompt_mean": 0.5}, ValueError, "prompt_mean"),
        ({"output_mean": "200"}, TypeError, "output_mean"),
        ({"max_len": 1}, ValueError, "max_len"),
        ({"seed": -1}, ValueError, "seed"),
    ],
)
def test_workload_refuses_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_workload(**{"n_requests": 5, **kwargs})
    with pytest.raises(ValueError, match="prompt_len"):
        Request(rid=0, arrival=0, prompt_len=0, output_len=3)
