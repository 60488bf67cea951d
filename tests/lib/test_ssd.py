"""lib.ssd: the selective SSM unrolled into a masked (L, L) matrix per channel is the scan: equal to
lib.scan.selective_scan_ref from a zero state; its mask is lesson 01's causal mask with decays
under the diagonal; with one decay per channel it factors as L ∘ (C Bᵀ) (Mamba-2's SSD)."""

import pytest
import torch
from scan_builders import TOL64, bad_scan_cases, scan_inputs

from lib.masks import causal_mask
from lib.scan import selective_scan_ref
from lib.ssd import decay_mask, selective_scan_attention, ssm_attention_matrix


@pytest.mark.parametrize("b, l, d, n", [(1, 1, 1, 1), (2, 7, 3, 4), (1, 37, 5, 16)])
@pytest.mark.parametrize("x_sign", ["mixed", "negative"])
def test_the_masked_matrix_is_the_scan_in_fp64(b, l, d, n, x_sign):
    x, dl, A, B, C, D, _ = scan_inputs(b, l, d, n, seed=b + l + d + n, dtype=torch.float64, x_sign=x_sign)
    for skip in (None, D):
        torch.testing.assert_close(
            selective_scan_attention(x, dl, A, B, C, skip),
            selective_scan_ref(x, dl, A, B, C, skip),
            rtol=TOL64,
            atol=TOL64,
        )


def test_fp32_agrees_with_the_reference_and_keeps_the_input_dtype():
    # fp32: S_t − S_s is a difference of two cumulative sums, exact to ~ε·S_t (S_t < 5 here), then
    # exponentiated and summed over N and L; 1e-5 relative (~100 ε) holds with room, an error in the
    # algebra is O(1)
    x, dl, A, B, C, D, _ = scan_inputs(2, 64, 4, 8, seed=3)
    y = selective_scan_attention(x.half(), dl, A, B, C, D)
    assert y.dtype == torch.float16
    torch.testing.assert_close(
        selective_scan_attention(x, dl, A, B, C, D), selective_scan_ref(x, dl, A, B, C, D), rtol=1e-5, atol=1e-5
    )


def test_the_mask_is_the_causal_mask_with_decays_under_the_diagonal():
    _, dl, A, *_ = scan_inputs(2, 9, 3, 4, seed=5, dtype=torch.float64)
    M = decay_mask(dl, A)  # (B, D, N, L, L)
    assert M.shape == (2, 3, 4, 9, 9)
    causal = causal_mask(9, dtype=torch.float64)  # lesson 01's: 0 on and below the diagonal, −inf above
    assert torch.equal(torch.isinf(M), torch.isinf(causal).expand_as(M))  # −inf exactly where attention's is
    assert torch.equal(M.diagonal(dim1=-2, dim2=-1), torch.zeros(2, 3, 4, 9, dtype=torch.float64))
    # one step below the diagonal: the decay of one step, Δ_t·A (t = s + 1)
    one_step = dl[:, 1:].transpose(1, 2)[:, :, None, :] * A[None, :, :, None]  # (B, D, N, L − 1)
    torch.testing.assert_close(M.diagonal(offset=-1, dim1=-2, dim2=-1), one_step, rtol=TOL64, atol=TOL64)
    assert bool((M[~torch.isinf(M)] <= 0).all())  # A < 0, Δ >= 0: what is left only shrinks


def test_one_decay_per_channel_factors_as_a_mask_times_c_b_transposed():
    """Mamba-2's restriction (one A per channel or head, shared by the N state entries): then
    W = L ∘ (C Bᵀ) ∘ Δ_s, the structured masked attention of SSD, with L = exp(M) the same for every n."""
    x, dl, _, B, C, _, _ = scan_inputs(2, 11, 3, 5, seed=9, dtype=torch.float64)
    a = -torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    A = a[:, None].expand(3, 5).contiguous()
    W = ssm_attention_matrix(dl, A, B, C)  # (B, D, L, L)
    L = decay_mask(dl, A)[:, :, 0].exp()  # (B, D, L, L): entry n = 0 stands for all
    CB = torch.einsum("btn,bsn->bts", C, B)  # (B, L, L)
    torch.testing.assert_close(W, L * CB[:, None] * dl.transpose(1, 2)[:, :, None, :], rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(
        torch.einsum("bdts,bsd->btd", W, x), selective_scan_ref(x, dl, A, B, C), rtol=TOL64, atol=TOL64
    )


EXTRAS = {"h0", "z", "delta_bias", "delta_softplus"}  # the masked form takes no initial state and no mixer extras


@pytest.mark.parametrize("case", [c for c in bad_scan_cases() if not EXTRAS & set(c[1])], ids=lambda c: c[0])
def test_refuses_bad_inputs_like_the_scans(case):
    _, kwargs, error, message = case
    with pytest.raises(error) as info:
        selective_scan_attention(**kwargs)
    assert str(info.value) == message


def test_decay_mask_refuses_mismatched_shapes():
    _, dl, A, *_ = scan_inputs(1, 4, 3, 2)
    with pytest.raises(ValueError, match=r"A must have shape \(D, N\) with D = delta.shape\[2\] = 3"):
        decay_mask(dl, A[:2])
    with pytest.raises(ValueError, match=r"delta must have shape \(B, L, D\) \(3 dims\)"):
        decay_mask(dl[0], A)
