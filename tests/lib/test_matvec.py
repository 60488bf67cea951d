"""lib.kernels.matvec.linear equals F.linear (its `linear_ref`) for every row count, thread count and
inner size, with and without a bias, forward and backward; it splits only what it should."""

import pytest
import torch

from lib.course.bench import torch_threads
from lib.kernels.matvec import MAX_SPLIT_ROWS, column_major, is_column_major, linear, linear_ref, split_parts

# fp32: P partial sums of K/P products each, added, against one BLAS dot product of K; both round
# each product once, the order differs: a few units in the last place of |x|·|w| sums (~1e-5 here).
ATOL = {torch.float32: 2e-5, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 5, MAX_SPLIT_ROWS, MAX_SPLIT_ROWS + 1])
@pytest.mark.parametrize("K", [96, 97])  # 97 is prime: no split but 1
def test_split_product_equals_f_linear(dtype, threads, rows, K):
    g = torch.Generator().manual_seed(rows * K)
    w = torch.randn(40, K, generator=g, dtype=dtype) - 0.3  # negative and positive weights
    b = torch.randn(40, generator=g, dtype=dtype)
    x = torch.randn(rows, K, generator=g, dtype=dtype)
    with torch_threads(threads):
        for bias in (None, b):
            torch.testing.assert_close(
                linear(x, column_major(w), bias), linear_ref(x, w, bias), atol=ATOL[dtype], rtol=0
            )
            torch.testing.assert_close(
                linear(x.view(1, rows, K), column_major(w), bias),
                linear_ref(x, w, bias).view(1, rows, 40),
                atol=ATOL[dtype],
                rtol=0,
            )


def test_gradients_flow_through_the_split_product():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g, dtype=torch.float64)
    x = torch.randn(1, 64, generator=g, dtype=torch.float64)
    grads = []
    for weight in (column_major(w), w):
        weight = weight.clone().requires_grad_()
        xx = x.clone().requires_grad_()
        with torch_threads(2):
            (linear(xx, weight) ** 2).sum().backward()
        grads.append((xx.grad, weight.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_column_major_keeps_shape_and_values_and_only_that_layout_is_split(monkeypatch):
    w = torch.arange(12.0).view(3, 4)
    cm = column_major(w)
    assert cm.shape == w.shape and torch.equal(cm, w) and is_column_major(cm) and not is_column_major(w)
    calls = []
    monkeypatch.setattr(torch, "bmm", lambda *a: calls.append(1) or torch.matmul(*a))
    with torch_threads(2):
        linear(torch.ones(1, 4), w)  # row-major: F.linear
        linear(torch.ones(MAX_SPLIT_ROWS + 1, 4), cm)  # a prefill: F.linear
        assert not calls
        linear(torch.ones(1, 4), cm)
        assert calls


def test_split_parts_divides_the_inner_size():
    with torch_threads(3):
        assert split_parts(576) == 3 and split_parts(64) == 2 and split_parts(97) == 1
