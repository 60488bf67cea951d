"""Build track 05's checks (lib.course.exercises.build05): each passes its solution, refuses the stub, and names
the mistake in at least three plausible wrong versions of its step."""

import math

import pytest
import torch

import lib.course.exercises.build05 as checks
from lib.attention import attention_ref

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- solutions (as the track's)
def _mask(s, q_start, k_start, causal, rule="absolute"):
    if not causal:
        return s
    i = torch.arange(s.shape[-2]).unsqueeze(1)
    j = torch.arange(s.shape[-1]).unsqueeze(0)
    blocked = {"absolute": k_start + j > q_start + i, "local": j > i, "diagonal": k_start + j >= q_start + i}[rule]
    return s.masked_fill(blocked, NEG_INF)


def fold_key_tile(m, l, acc, q, k, v, scale, q_start, k_start, causal):
    s = _mask((q @ k.transpose(-2, -1)) * scale, q_start, k_start, causal)
    m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    p = torch.exp(s - m_safe)
    alpha = torch.exp(m - m_safe)
    return m_new, l * alpha + p.sum(dim=-1, keepdim=True), acc * alpha + p @ v


def forward_query_tile(q, k, v, q_start, scale, causal, block_n, fold=fold_key_tile):
    B, H, bq, D = q.shape
    T = k.shape[2]
    m, l, acc = q.new_full((B, H, bq, 1), NEG_INF), q.new_zeros(B, H, bq, 1), q.new_zeros(B, H, bq, D)
    for k_start in range(0, min(q_start + bq, T) if causal else T, block_n):
        k_end = min(k_start + block_n, T)
        m, l, acc = fold(m, l, acc, q, k[:, :, k_start:k_end], v[:, :, k_start:k_end], scale, q_start, k_start, causal)
    return acc / l, (m + torch.log(l)).squeeze(-1)


def flash_forward(q, k, v, causal=False, block_m=16, block_n=16, tile=forward_query_tile):
    B, H, T, D = q.shape
    O, L = torch.empty_like(q), q.new_empty(B, H, T)
    for q_start in range(0, T, block_m):
        q_end = min(q_start + block_m, T)
        O[:, :, q_start:q_end], L[:, :, q_start:q_end] = tile(
            q[:, :, q_start:q_end], k, v, q_start, 1 / math.sqrt(D), causal, block_n
        )
    return O, L


def backward_tile(q, k, v, do, L, delta, scale, q_start, k_start, causal):
    s = _mask((q @ k.transpose(-2, -1)) * scale, q_start, k_start, causal)
    p = torch.exp(s - L.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ do
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


def flash_backward(
    q,
    k,
    v,
    o,
    L,
    do,
    causal=False,
    block_m=16,
    block_n=16,
    tile=backward_tile,
    delta_of=lambda do, o: (do * o).sum(-1),
    accumulate=True,
):
    B, H, T, D = q.shape
    delta = delta_of(do, o)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q_start in range(0, T, block_m):
        rows = slice(q_start, min(q_start + block_m, T))
        for k_start in range(0, rows.stop if causal else T, block_n):
            cols = slice(k_start, min(k_start + block_n, T))
            parts = tile(
                q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                do[:, :, rows],
                L[:, :, rows],
                delta[:, :, rows],
                1 / math.sqrt(D),
                q_start,
                k_start,
                causal,
            )
            if accumulate:
                dq[:, :, rows] += parts[0]
                dk[:, :, cols] += parts[1]
                dv[:, :, cols] += parts[2]
            else:
                dq[:, :, rows], dk[:, :, cols], dv[:, :, cols] = parts
    return dq, dk, dv


SOLUTIONS = {
    "check_fold_key_tile": fold_key_tile,
    "check_forward_query_tile": forward_query_tile,
    "check_flash_forward": flash_forward,
    "check_backward_tile": backward_tile,
    "check_flash_backward": flash_backward,
}


# --------------------------------------------------------------------------- wrong versions, step 5.1
def fold_without_rescaling_acc(m, l, acc, q, k, v, scale, q_start, k_start, causal):
    s = _mask((q @ k.transpose(-2, -1)) * scale, q_start, k_start, causal)
    m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    p = torch.exp(s - m_safe)
    return m_new, l * torch.exp(m - m_safe) + p.sum(dim=-1, keepdim=True), acc + p @ v


def fold_normalised(m, l, acc, q, k, v, scale, q_start, k_start, causal):
    m, l, acc = fold_key_tile(m, l, acc, q, k, v, scale, q_start, k_start, causal)
    return m, l, acc / torch.where(l == 0, torch.ones_like(l), l)


def fold_unscaled(m, l, acc, q, k, v, scale, q_start, k_start, causal):
    return fold_key_tile(m, l, acc, q, k, v, 1.0, q_start, k_start, causal)


def fold_without_mask(m, l, acc, q, k, v, scale, q_start, k_start, causal):
    return fold_key_tile(m, l, acc, q, k, v, scale, q_start, k_start, False)


def fold_local_mask(m, l, acc, q, k, v, scale, q_start, k_start, causal):
    return fold_key_tile(m, l, acc, q, k, v, scale, 0, 0, causal)


def fold_nan_on_empty_rows(m, l, acc, q, k, v, scale, q_start, k_start, causal):
    s = _mask((q @ k.transpose(-2, -1)) * scale, q_start, k_start, causal)
    m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
    p, alpha = torch.exp(s - m_new), torch.exp(m - m_new)
    return m_new, l * alpha + p.sum(dim=-1, keepdim=True), acc * alpha + p @ v


def fold_masks_with_a_finite_number(m, l, acc, q, k, v, scale, q_start, k_start, causal):
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        i, j = torch.arange(s.shape[-2]).unsqueeze(1), torch.arange(s.shape[-1]).unsqueeze(0)
        s = s.masked_fill(k_start + j > q_start + i, -1e9)
    m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
    p, alpha = torch.exp(s - m_new), torch.exp(m - m_new)
    return m_new, l * alpha + p.sum(dim=-1, keepdim=True), acc * alpha + p @ v


def fold_returns_two(m, l, acc, q, k, v, scale, q_start, k_start, causal):
    return fold_key_tile(m, l, acc, q, k, v, scale, q_start, k_start, causal)[1:]


# --------------------------------------------------------------------------- step 5.2
def tile_lse_without_max(q, k, v, q_start, scale, causal, block_n):
    o, L = forward_query_tile(q, k, v, q_start, scale, causal, block_n)
    B, H, bq, D = q.shape
    # recompute log(l) alone: L - m, with m the rows' max over the visible keys
    s = _mask((q @ k.transpose(-2, -1)) * scale, q_start, 0, causal)
    return o, L - s.amax(-1)


def tile_normalised_in_loop(q, k, v, q_start, scale, causal, block_n):
    def fold(*args):
        m, l, acc = fold_key_tile(*args)
        return m, l, acc / l.clamp_min(1e-30)

    return forward_query_tile(q, k, v, q_start, scale, causal, block_n, fold=fold)


def tile_skips_partial_key_tile(q, k, v, q_start, scale, causal, block_n):
    T = k.shape[2]
    full = T - T % block_n
    if full == 0:
        return forward_query_tile(q, k, v, q_start, scale, causal, block_n)
    # only whole tiles: the keys of a partial last tile are never seen
    B, H, bq, D = q.shape
    m, l, acc = q.new_full((B, H, bq, 1), NEG_INF), q.new_zeros(B, H, bq, 1), q.new_zeros(B, H, bq, D)
    for k_start in range(0, min(min(q_start + bq, T) if causal else T, full), block_n):
        m, l, acc = fold_key_tile(
            m,
            l,
            acc,
            q,
            k[:, :, k_start : k_start + block_n],
            v[:, :, k_start : k_start + block_n],
            scale,
            q_start,
            k_start,
            causal,
        )
    return acc / l, (m + torch.log(l)).squeeze(-1)


def tile_without_causal_skip(q, k, v, q_start, scale, causal, block_n):
    B, H, bq, D = q.shape
    T = k.shape[2]
    m, l, acc = q.new_full((B, H, bq, 1), NEG_INF), q.new_zeros(B, H, bq, 1), q.new_zeros(B, H, bq, D)
    for k_start in range(0, T, block_n):  # every key tile, even those after every query of the tile
        k_end = min(k_start + block_n, T)
        m, l, acc = fold_key_tile(
            m, l, acc, q, k[:, :, k_start:k_end], v[:, :, k_start:k_end], scale, q_start, k_start, causal
        )
    return acc / l, (m + torch.log(l)).squeeze(-1)


def tile_with_broken_fold(q, k, v, q_start, scale, causal, block_n):
    return forward_query_tile(q, k, v, q_start, scale, causal, block_n, fold=fold_without_rescaling_acc)


def tile_l_as_column(q, k, v, q_start, scale, causal, block_n):
    o, L = forward_query_tile(q, k, v, q_start, scale, causal, block_n)
    return o, L.unsqueeze(-1)


# --------------------------------------------------------------------------- step 5.3
def forward_skips_partial_query_tile(q, k, v, causal=False, block_m=16, block_n=16):
    B, H, T, D = q.shape
    O, L = torch.empty_like(q), q.new_empty(B, H, T)  # the rows of a partial last tile stay garbage
    for q_start in range(0, T - block_m + 1, block_m):
        O[:, :, q_start : q_start + block_m], L[:, :, q_start : q_start + block_m] = forward_query_tile(
            q[:, :, q_start : q_start + block_m], k, v, q_start, 1 / math.sqrt(D), causal, block_n
        )
    return O, L


def forward_with_tile_index(q, k, v, causal=False, block_m=16, block_n=16):
    B, H, T, D = q.shape
    O, L = torch.empty_like(q), q.new_empty(B, H, T)
    for i, q_start in enumerate(range(0, T, block_m)):
        q_end = min(q_start + block_m, T)
        O[:, :, q_start:q_end], L[:, :, q_start:q_end] = forward_query_tile(
            q[:, :, q_start:q_end], k, v, i, 1 / math.sqrt(D), causal, block_n
        )
    return O, L


def forward_scaled_by_d(q, k, v, causal=False, block_m=16, block_n=16):
    B, H, T, D = q.shape
    O, L = torch.empty_like(q), q.new_empty(B, H, T)
    for q_start in range(0, T, block_m):
        q_end = min(q_start + block_m, T)
        O[:, :, q_start:q_end], L[:, :, q_start:q_end] = forward_query_tile(
            q[:, :, q_start:q_end], k, v, q_start, 1 / D, causal, block_n
        )
    return O, L


def forward_with_lse_bug(q, k, v, causal=False, block_m=16, block_n=16):
    return flash_forward(q, k, v, causal, block_m, block_n, tile=tile_lse_without_max)


def forward_with_fold_bug(q, k, v, causal=False, block_m=16, block_n=16):
    return flash_forward(q, k, v, causal, block_m, block_n, tile=tile_with_broken_fold)


# --------------------------------------------------------------------------- step 5.4
def backward_tile_without_delta(q, k, v, do, L, delta, scale, q_start, k_start, causal):
    return backward_tile(q, k, v, do, L, torch.zeros_like(delta), scale, q_start, k_start, causal)


def backward_tile_without_scale(q, k, v, do, L, delta, scale, q_start, k_start, causal):
    dq, dk, dv = backward_tile(q, k, v, do, L, delta, scale, q_start, k_start, causal)
    return dq / scale, dk / scale, dv


def backward_tile_unscaled_dq(q, k, v, do, L, delta, scale, q_start, k_start, causal):
    dq, dk, dv = backward_tile(q, k, v, do, L, delta, scale, q_start, k_start, causal)
    return dq / scale, dk, dv


def backward_tile_without_mask(q, k, v, do, L, delta, scale, q_start, k_start, causal):
    return backward_tile(q, k, v, do, L, delta, scale, q_start, k_start, False)


def backward_tile_softmax(q, k, v, do, L, delta, scale, q_start, k_start, causal):
    s = _mask((q @ k.transpose(-2, -1)) * scale, q_start, k_start, causal)
    p = torch.softmax(s, dim=-1)  # normalised over this tile only
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ do


def backward_tile_dv_untransposed(q, k, v, do, L, delta, scale, q_start, k_start, causal):
    dq, dk, _ = backward_tile(q, k, v, do, L, delta, scale, q_start, k_start, causal)
    s = _mask((q @ k.transpose(-2, -1)) * scale, q_start, k_start, causal)
    return dq, dk, torch.exp(s - L.unsqueeze(-1)) @ v  # P V, the forward's product, not Pᵀ dO


def backward_tile_l_not_unsqueezed(q, k, v, do, L, delta, scale, q_start, k_start, causal):
    s = _mask((q @ k.transpose(-2, -1)) * scale, q_start, k_start, causal)
    p = torch.exp(s - L)  # (B, H, bq, bk) - (B, H, bq): broadcast along the wrong axis
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ do


# --------------------------------------------------------------------------- step 5.5
def backward_delta_without_o(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    return flash_backward(q, k, v, o, L, do, causal, block_m, block_n, delta_of=lambda do, o: do.sum(-1))


def backward_overwrites(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    return flash_backward(q, k, v, o, L, do, causal, block_m, block_n, accumulate=False)


def backward_skips_diagonal(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    B, H, T, D = q.shape
    delta = (do * o).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q_start in range(0, T, block_m):
        rows = slice(q_start, min(q_start + block_m, T))
        for k_start in range(0, q_start if causal else T, block_n):  # stops before the diagonal
            cols = slice(k_start, min(k_start + block_n, T))
            parts = backward_tile(
                q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                do[:, :, rows],
                L[:, :, rows],
                delta[:, :, rows],
                1 / math.sqrt(D),
                q_start,
                k_start,
                causal,
            )
            dq[:, :, rows] += parts[0]
            dk[:, :, cols] += parts[1]
            dv[:, :, cols] += parts[2]
    return dq, dk, dv


def backward_with_tile_bug(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    return flash_backward(q, k, v, o, L, do, causal, block_m, block_n, tile=backward_tile_without_delta)


my_backward_tile = backward_tile  # what a notebook's Step 5.4 cell defines, called by its name below


def my_flash_backward(q, k, v, o, L, do, causal=False, block_m=16, block_n=16, skip=True):
    """As the notebook writes it: the tile function found by its name in the notebook's globals."""
    B, H, T, D = q.shape
    delta = (do * o).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q_start in range(0, T, block_m):
        rows = slice(q_start, min(q_start + block_m, T))
        for k_start in range(0, rows.stop if causal and skip else T, block_n):
            cols = slice(k_start, min(k_start + block_n, T))
            dq_t, dk_t, dv_t = my_backward_tile(
                q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                do[:, :, rows],
                L[:, :, rows],
                delta[:, :, rows],
                1 / math.sqrt(D),
                q_start,
                k_start,
                causal,
            )
            dq[:, :, rows] += dq_t
            dk[:, :, cols] += dk_t
            dv[:, :, cols] += dv_t
    return dq, dk, dv


def backward_without_causal_skip(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    """Every key tile for every query tile: the sums are right (a future tile's P is 0), the work is not."""
    return my_flash_backward(q, k, v, o, L, do, causal, block_m, block_n, skip=False)


WRONG_VERSIONS = {
    "check_fold_key_tile": [
        (fold_without_rescaling_acc, "acc was not rescaled"),
        (fold_normalised, "keep acc unnormalised"),
        (fold_unscaled, "not scaled"),
        (fold_without_mask, "causal mask is missing"),
        (fold_local_mask, "absolute positions"),
        (fold_nan_on_empty_rows, "exp(-inf - (-inf)) is NaN"),
        (fold_masks_with_a_finite_number, "not a large negative number"),
        (fold_returns_two, "expected a tuple (m, l, acc)"),
    ],
    "check_forward_query_tile": [
        (tile_lse_without_max, "L = m + log(l)"),
        (tile_normalised_in_loop, "inside the loop"),
        (tile_skips_partial_key_tile, "partial"),
        (tile_without_causal_skip, "wholly after the tile's last query"),
        (tile_with_broken_fold, "Step 5.1"),
        (tile_l_as_column, "squeeze(-1)"),
    ],
    "check_flash_forward": [
        (forward_skips_partial_query_tile, "the last query tile is partial"),
        (forward_with_tile_index, "q_start is the position of its first query"),
        (forward_scaled_by_d, "not 1 / D"),
        (forward_with_lse_bug, "Step 5.2"),
        (forward_with_fold_bug, "Step 5.1"),
    ],
    "check_backward_tile": [
        (backward_tile_without_delta, "dS = P ∘ (dP - delta)"),
        (backward_tile_without_scale, "dQ and dK miss the scale"),
        (backward_tile_unscaled_dq, "dQ misses the scale"),
        (backward_tile_without_mask, "causal mask"),
        (backward_tile_softmax, "this tile's keys only"),
        (backward_tile_dv_untransposed, "dV = Pᵀ dO"),
        (backward_tile_l_not_unsqueezed, "L.unsqueeze(-1)"),
    ],
    "check_flash_backward": [
        (backward_delta_without_o, "forgot O"),
        (backward_overwrites, "instead of adding"),
        (backward_skips_diagonal, "diagonal tiles were skipped"),
        (backward_with_tile_bug, "Step 5.4"),
        (backward_without_causal_skip, "causal skip is missing"),
    ],
}


# --------------------------------------------------------------------------- what the checks rest on
def test_the_backward_check_watches_the_tiles_and_puts_the_notebooks_function_back():
    """Step 5.5 records which tiles the notebook's my_backward_tile runs on, passes a loop with the
    causal skip, and leaves the notebook's function as it found it."""
    assert checks.check_flash_backward(my_flash_backward).passed
    assert my_backward_tile is backward_tile
    with checks._tiles_visited(backward_without_causal_skip) as visited:
        o, L = checks._forward_truth(*(torch.randn(1, 1, 9, 4) for _ in range(3)), True)
        backward_without_causal_skip(
            *(torch.randn(1, 1, 9, 4) for _ in range(3)), o, L, torch.randn(1, 1, 9, 4), True, 4, 4
        )
    assert sorted(visited) == [(qs, ks, min(4, 9 - qs)) for qs in (0, 4, 8) for ks in (0, 4, 8)]
    assert checks._future_tiles(visited, 9, 4, 4, True) == [(0, 4), (0, 8), (4, 8)]
    assert my_backward_tile is backward_tile


def test_the_second_fold_case_really_raises_the_running_max():
    """Case 2 of step 5.1 exists to catch a missing rescale: the max must rise in some row."""
    _, second = checks._fold_cases()[1]
    assert bool((checks._lib_fold(*second)[0] > second[0]).any())


def test_the_references_are_right_when_no_mistake_is_asked_for():
    """The wrong versions are recomputed by references with a flag per mistake: without flags they must
    equal lib (else a diagnosis could name a mistake the learner did not make)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 2, 21, 8, generator=g) for _ in range(4))
    for causal in (False, True):
        o, L = checks._forward_truth(q, k, v, causal)
        got = checks._flash_forward(q, k, v, causal, 8, 5)
        torch.testing.assert_close(got[0], attention_ref(q, k, v, causal=causal), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], L, rtol=1e-5, atol=1e-5)
        grads = checks._flash_backward(q, k, v, o, L, do, causal, 8, 5)
        leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
        truth = torch.autograd.grad(attention_ref(*leaves, causal=causal), leaves, do)
        for a, b in zip(grads, truth):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_poisoned_case_only_poisons_keys_the_tile_never_needs():
    """Step 5.2's NaN keys start after the key tile holding the query tile's last position."""
    q = torch.randn(1, 1, 4, 8)
    k, v = checks._poisoned(torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8), 4)
    o, L = forward_query_tile(q, k, v, 0, 8**-0.5, True, 4)
    assert bool(torch.isfinite(o).all() & torch.isfinite(L).all())


def test_the_real_case_compares_with_smollm2s_own_attention():
    """The real queries, keys and values reproduce the model's attention output, and the forward and
    backward checks run their real case (one more than the random ones) when the model is installed."""
    real = checks.real_attention_inputs()
    if real is None:
        pytest.skip("SmolLM2-135M-Instruct is not installed")
    q, k, v, out = real
    assert q.shape[1] == 9 and q.shape[3] == 64 and q.shape[2] > 16
    torch.testing.assert_close(attention_ref(q, k, v, causal=True), out, rtol=1e-4, atol=1e-5 * out.abs().max().item())
    forward, backward = checks.check_flash_forward(flash_forward), checks.check_flash_backward(flash_backward)
    assert forward.passed and forward.n_cases == 5 and "skipped" not in forward.exercise
    assert backward.passed and backward.n_cases == 5 and "skipped" not in backward.exercise


def test_a_later_step_says_when_an_earlier_step_is_still_the_stub():
    """Step 5.2 run with Step 5.1 unsolved: the report names Step 5.1, not this step, as the stub."""

    def my_fold_key_tile(*args):
        raise NotImplementedError

    def my_forward_query_tile(q, k, v, q_start, scale, causal, block_n):
        return forward_query_tile(q, k, v, q_start, scale, causal, block_n, fold=my_fold_key_tile)

    report = checks.check_forward_query_tile(my_forward_query_tile)
    assert report.problem == "not attempted yet" and "Step 5.1" in report.hint, report
    assert "my_fold_key_tile" in report.hint and "NotImplementedError" in report.hint
