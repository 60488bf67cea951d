"""lib.rope: the fast rotation equals the pair-by-pair reference; scores depend only on the offset
between positions (and a wrongly paired table visibly breaks that); rotation keeps norms and
position 0 is the identity; parity with Hugging Face Llama; half precision keeps its dtype; bad
input, the half-width table above all, gets a clear error."""

import pytest
import torch
from refusals import built, not_float, refusal_test

from lib.rope import apply_rope, apply_rope_ref, rope_cos_sin, rope_frequencies, rotate_half, rotate_interleaved

EPS32 = torch.finfo(torch.float32).eps  # 2^-23, one ulp at 1.0


def rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def fp32_rotation_tol(x):
    # Each output x_i·cos ± x_j·sin has magnitude <= 2·max|x| and passes ~4 float32 roundings
    # (cos, sin, two products and the sum; the cast of the float64 truth adds half an ulp),
    # each at most eps/2 relative: 2·max|x|·4·eps/2 = 4·eps·max|x|.
    return 4 * EPS32 * x.abs().max().item()


@pytest.mark.parametrize(
    "T, D, offset",
    [(37, 16, 0), (37, 16, 5), (1, 16, 0), (1, 2, 0), (8, 2, 3), (13, 64, 1000), (4, 64, 100_000)],
)
def test_apply_rope_equals_the_pairwise_rotation_reference(T, D, offset):
    x = rand(2, 3, T, D, seed=T + D)
    out = apply_rope(x, *rope_cos_sin(T, D, offset=offset))
    truth = apply_rope_ref(x.double(), torch.arange(offset, offset + T))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (out.double() - truth).abs().max().item() <= fp32_rotation_tol(x)


def rotated(v, position, table=rope_cos_sin):
    """One (D,) vector rotated for one absolute position."""
    D = v.shape[0]
    return apply_rope(v.view(1, 1, 1, D), *table(1, D, offset=position)).view(D)  # (D,) -> (1, 1, 1, D) -> (D,)


def score_tol(q, k):
    # A float32 dot product of D terms is off by at most ~D·eps·Σ|q_i k_i| <= D·eps·|q||k|
    # (Cauchy-Schwarz; rotation keeps both norms), plus the rotation's own few-ulp error per
    # channel; two scores are compared, so twice that.
    D = q.shape[0]
    return 2 * (D + 8) * EPS32 * (q.norm() * k.norm()).item()


PAIRS = [(3, 7), (10, 2), (0, 0), (5, 0)]
SHIFTS = [1, 5, 100, 1000, 4000]


def test_scores_depend_only_on_the_relative_position():
    D = 64
    q, k = rand(D, seed=1), rand(D, seed=2)
    tol = score_tol(q, k)
    for m, n in PAIRS:
        score = rotated(q, m) @ rotated(k, n)
        for s in SHIFTS:
            assert abs((rotated(q, m + s) @ rotated(k, n + s) - score).item()) <= tol, (m, n, s)
        # the same score with the query moved to position 0: q·R_(n-m) k
        if n >= m:
            assert abs((q @ rotated(k, n - m) - score).item()) <= tol, (m, n)


def repeat_interleaved_table(T, D, *, offset=0):
    """The wrong pairing: angles laid out (θ_0, θ_0, θ_1, θ_1, ...) as the interleaved convention
    wants, then used with rotate_half, which pairs channel i with i + D/2."""
    angles = torch.outer(torch.arange(offset, offset + T, dtype=torch.float64), rope_frequencies(D).double())
    angles = angles.repeat_interleave(2, dim=-1)  # (T, D/2) -> (T, D)
    return angles.cos().float(), angles.sin().float()


def test_wrongly_paired_table_breaks_relative_invariance():
    D = 64
    q, k = rand(D, seed=1), rand(D, seed=2)
    tol = score_tol(q, k)
    # the table has the right shape, so no check can catch it: only the property test does
    assert repeat_interleaved_table(1, D)[0].shape == rope_cos_sin(1, D)[0].shape
    worst = 0.0
    for m, n in PAIRS:
        score = rotated(q, m, repeat_interleaved_table) @ rotated(k, n, repeat_interleaved_table)
        for s in SHIFTS:
            shifted = rotated(q, m + s, repeat_interleaved_table) @ rotated(k, n + s, repeat_interleaved_table)
            worst = max(worst, abs((shifted - score).item()))
    assert worst > 1000 * tol  # observed: errors of order 1 to 10 on scores of order 8


def test_rotation_preserves_the_norm_of_every_vector():
    x = rand(2, 4, 50, 32, seed=3)
    out = apply_rope(x, *rope_cos_sin(50, 32, offset=4000))
    # |x|^2 summed over 32 channels of size ~1: float32 relative error a few eps
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), rtol=16 * EPS32, atol=0)


def test_position_zero_is_the_identity():
    x = rand(2, 3, 5, 16, seed=4)
    out = apply_rope(x, *rope_cos_sin(5, 16))
    assert torch.equal(out[:, :, 0], x[:, :, 0])  # cos 0 = 1 and sin 0 = 0 exactly
    assert not torch.allclose(out[:, :, 1], x[:, :, 1])


def test_frequencies_follow_base_to_the_minus_2i_over_d():
    theta = rope_frequencies(16, base=10000.0)
    assert theta.shape == (8,) and theta.dtype == torch.float32
    expected = torch.tensor([10000.0 ** (-2 * i / 16) for i in range(8)], dtype=torch.float32)
    assert torch.allclose(theta, expected, rtol=EPS32, atol=0)
    assert theta[0] == 1.0 and (theta[1:] < theta[:-1]).all()


def test_cos_sin_tables_are_the_half_table_concatenated_and_offset_slices_the_long_table():
    cos, sin = rope_cos_sin(9, 12)
    assert cos.shape == sin.shape == (9, 12) and cos.dtype == torch.float32
    assert torch.equal(cos[:, :6], cos[:, 6:]) and torch.equal(sin[:, :6], sin[:, 6:])
    long_cos, long_sin = rope_cos_sin(20, 12)
    cos_o, sin_o = rope_cos_sin(7, 12, offset=13)
    assert torch.equal(cos_o, long_cos[13:]) and torch.equal(sin_o, long_sin[13:])
    cos64, _ = rope_cos_sin(9, 12, dtype=torch.float64)
    assert cos64.dtype == torch.float64 and torch.equal(cos64.float(), cos)


def test_rotate_half_turns_each_pair_a_quarter():
    x = torch.arange(1.0, 7.0)  # (x1 | x2) = (1, 2, 3 | 4, 5, 6)
    assert torch.equal(rotate_half(x), torch.tensor([-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]))
    y = rand(3, 4, 10, seed=5)
    assert torch.equal(rotate_half(rotate_half(y)), -y)  # two quarter turns make a half turn


x0 = rand(2, 3, 6, 8, seed=7)
cos0, sin0 = rope_cos_sin(6, 8)
_ANGLES = torch.outer(torch.arange(6.0), rope_frequencies(8))  # (T, D/2), the table before the cat
_HALF_WIDTH = (  # the whole message for a (T, D/2) table named {0}
    "{0} has shape (6, 4) = (T, D/2): that is the half-width angle table, one angle per "
    "channel pair. Both channels of a pair need it, so it must be widened to (T, D) = (6, 8): "
    "torch.cat([{0}, {0}], dim=-1) for the rotate-half pairs (i, i + D/2), or "
    "{0}.repeat_interleave(2, dim=-1) for the interleaved pairs (2i, 2i + 1), each with its "
    "own rotation; rope_cos_sin does this (layout='half' or 'interleaved')"
)
# fmt: off
APPLY_ROPE_REFUSALS = [
    # the half-width table, the (T, D/2) angles before the cat, in both or in one of the tables
    ("cos, sin", (_ANGLES.cos(), _ANGLES.sin()), ValueError, _HALF_WIDTH.format("cos")),
    ("sin", _ANGLES.sin(), ValueError, _HALF_WIDTH.format("sin")),
    ("x", x0.long(), TypeError, not_float("x")),
    ("x", x0[0], ValueError, "x must have shape (B, H, T, D) (4 dims), got (3, 6, 8)"),
    ("x, cos, sin", (x0[..., :7], cos0[:, :7], sin0[:, :7]), ValueError,
     "x must have an even head dim D (channels are rotated in pairs), got x (2, 3, 6, 7)"),
    ("cos", cos0[:5], ValueError, "cos must have shape (T, D) = (6, 8) to match x (B, H, T, D), got (5, 8)"),
    ("sin", sin0[None], ValueError, "sin must have shape (T, D) = (6, 8) to match x (B, H, T, D), got (1, 6, 8)"),
    ("cos", cos0.long(), TypeError, not_float("cos")),
    ("cos", cos0.to("meta"), ValueError, "x, cos must share one device, got x: cpu, cos: meta"),
    ("x", x0.tolist(), TypeError, "x must be a torch.Tensor, got list"),
    ("layout", "pairs", ValueError,
     "layout must be one of ('half', 'interleaved') (which channels form a pair), got 'pairs'"),
]
# fmt: on
test_apply_rope_refusals = refusal_test(apply_rope, dict(x=x0, cos=cos0, sin=sin0, layout="half"), APPLY_ROPE_REFUSALS)


# fmt: off
ROPE_COS_SIN_REFUSALS = [
    ("D", 7, ValueError, "D must be even (channels are rotated in pairs), got 7"),
    ("T", 0, ValueError, "T must be >= 1, got 0"),
    ("D", 8.0, TypeError, "D must be an int, got float"),
    ("offset", -1, ValueError, "offset must be >= 0, got -1"),
    ("base", 0.5, ValueError, "base must be a finite number > 1 (10000.0 in the paper and Llama), got 0.5"),
    ("dtype", torch.int64, TypeError, "dtype must be a floating torch.dtype, got torch.int64"),
    ("layout", "complex", ValueError,
     "layout must be one of ('half', 'interleaved') (which channels form a pair), got 'complex'"),
]
# fmt: on
test_rope_cos_sin_refusals = refusal_test(rope_cos_sin, dict(T=6, D=8), ROPE_COS_SIN_REFUSALS)


# fmt: off
APPLY_ROPE_REF_REFUSALS = [
    ("positions", torch.arange(5), ValueError,
     "positions must have shape (T,) = (6,) to match x (B, H, T, D), got (5,)"),
    ("positions", torch.arange(6.0), TypeError, "positions must be an integer tensor, got torch.float32"),
    ("x", x0[..., :7], ValueError,
     "x must have an even head dim D (channels are rotated in pairs), got x (2, 3, 6, 7)"),
    ("layout", None, ValueError,
     "layout must be one of ('half', 'interleaved') (which channels form a pair), got None"),
    ("base", 0.5, ValueError, "base must be a finite number > 1 (10000.0 in the paper and Llama), got 0.5"),
]
# fmt: on
test_apply_rope_ref_refusals = refusal_test(
    apply_rope_ref, built(lambda: dict(x=x0, positions=torch.arange(6))), APPLY_ROPE_REF_REFUSALS
)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: rope_frequencies(-4), ValueError, "D must be >= 1"),
        (lambda: rotate_half(torch.ones(3, 5)), ValueError, r"x must have shape \(..., D\) with D even"),
    ],
)
def test_bad_input_raises_a_clear_error_naming_the_argument(call, error, words):
    with pytest.raises(error, match=words):
        call()


@pytest.mark.parametrize("offset", [0, 100])
def test_matches_hugging_face_llama_rotary_embedding(offset):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    B, H, T, D = 2, 4, 37, 16
    config = LlamaConfig(
        hidden_size=H * D,
        num_attention_heads=H,
        head_dim=D,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    q, k = rand(B, H, T, D, seed=8), rand(B, H, T, D, seed=9)
    position_ids = torch.arange(offset, offset + T)[None]  # (1, T)
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(q, position_ids)  # each (1, T, D)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)  # unsqueeze_dim=1: (1, 1, T, D) over (B, H, T, D)

    theta_hf = LlamaRotaryEmbedding(config).inv_freq
    assert torch.allclose(rope_frequencies(D), theta_hf, rtol=2 * EPS32, atol=0)
    # Hugging Face forms the angles p·θ in float32: each is off by up to half an ulp of p·θ <= p,
    # so by <= (offset+T)·eps/2 rad, which moves an output by at most 2·max|x| times that; on top
    # of it both sides round the rotation itself (fp32_rotation_tol each).
    angle_err = (offset + T) * EPS32 / 2
    cos, sin = rope_cos_sin(T, D, offset=offset)
    for ours_in, theirs in ((q, q_hf), (k, k_hf)):
        tol = 2 * ours_in.abs().max().item() * angle_err + 2 * fp32_rotation_tol(ours_in)
        assert (apply_rope(ours_in, cos, sin) - theirs).abs().max().item() <= tol


@pytest.mark.parametrize("dtype, ulp", [(torch.float16, 2.0**-10), (torch.bfloat16, 2.0**-7)])
def test_half_precision_keeps_its_dtype_and_rounds_once(dtype, ulp):
    x = rand(2, 2, 17, 64, seed=10, dtype=dtype)
    cos, sin = rope_cos_sin(17, 64, offset=50)
    out = apply_rope(x, cos, sin)
    assert out.dtype == dtype
    # Same (already rounded) input in float32: the only difference left is rounding the result to
    # `dtype`, at most half an ulp, i.e. 2^-11 (fp16) or 2^-8 (bf16) relative. Allow one ulp; the
    # atol covers subnormals, whose spacing is below the smallest normal number.
    expected = apply_rope(x.float(), cos, sin)
    assert torch.allclose(out.float(), expected, rtol=ulp, atol=torch.finfo(dtype).tiny)


# --------------------------------------------------------------------------- the interleaved convention
@pytest.mark.parametrize("T, D, offset", [(37, 16, 0), (1, 2, 0), (8, 2, 3), (13, 64, 1000)])
def test_the_interleaved_layout_is_the_pairwise_rotation_of_pairs_2i_2i_plus_1(T, D, offset):
    x = rand(2, 3, T, D, seed=T + D + 1)
    out = apply_rope(x, *rope_cos_sin(T, D, offset=offset, layout="interleaved"), layout="interleaved")
    truth = apply_rope_ref(x.double(), torch.arange(offset, offset + T), layout="interleaved")
    assert (out.double() - truth).abs().max().item() <= fp32_rotation_tol(x)
    if D > 2:  # one pair is the same pair in both layouts; more are not
        assert not torch.allclose(truth, apply_rope_ref(x.double(), torch.arange(offset, offset + T)))
    assert torch.equal(rotate_interleaved(torch.arange(6.0)), torch.tensor([-1.0, 0.0, -3.0, 2.0, -5.0, 4.0]))


def test_the_two_layouts_are_one_rotation_up_to_a_permutation_of_channels_and_mixing_them_breaks_it():
    """Interleaved channel 2i holds what rotate-half keeps in channel i, 2i + 1 what it keeps in i + D/2:
    permute, rotate, permute back, and the results agree. A table of one layout with the other's
    rotation is no rotation: the score of a fixed offset drifts as the pair moves."""
    T, D = 9, 16
    x = rand(1, 2, T, D, seed=7)
    to_interleaved = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], dim=-1).reshape(D)
    half = apply_rope(x, *rope_cos_sin(T, D))
    inter = apply_rope(x[..., to_interleaved], *rope_cos_sin(T, D, layout="interleaved"), layout="interleaved")
    torch.testing.assert_close(inter, half[..., to_interleaved], rtol=0, atol=fp32_rotation_tol(x))
    q, k = rand(D, seed=1), rand(D, seed=2)

    def drift(table_layout, rotation_layout):
        def rot(v, p):
            return apply_rope(
                v.view(1, 1, 1, D), *rope_cos_sin(1, D, offset=p, layout=table_layout), layout=rotation_layout
            ).view(D)

        return max(abs((rot(q, s) @ rot(k, s + 3) - rot(q, 0) @ rot(k, 3)).item()) for s in SHIFTS)

    tol = score_tol(q, k)
    assert drift("half", "half") <= tol and drift("interleaved", "interleaved") <= tol
    assert drift("interleaved", "half") > 1000 * tol and drift("half", "interleaved") > 1000 * tol
