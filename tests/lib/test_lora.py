"""lib.lora: a fresh adapter leaves the layer's output exactly unchanged; the forward is the base
plus the scaled low-rank product; only A and B learn (and A gets no gradient until B moves);
add_lora trains r·(in + out) numbers per wrapped layer; merging reproduces the trained model with
plain Linear layers; bad input gets a clear error and leaves the model untouched."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from refusals import assert_refuses, built, not_float, refusal_test, rows

from lib.attention import attention
from lib.lora import LoRALinear, add_lora, count_parameters, merge_lora

EPS32 = torch.finfo(torch.float32).eps


def rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def seeded_linear(i, o, seed=0, bias=True, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Linear(i, o, bias=bias, dtype=dtype)


def perturbed(layer: LoRALinear, seed=1) -> LoRALinear:
    with torch.no_grad():
        layer.lora_A.copy_(rand(*layer.lora_A.shape, seed=seed))
        layer.lora_B.copy_(rand(*layer.lora_B.shape, seed=seed + 1))
    return layer


def test_fresh_adapter_leaves_the_output_exactly_unchanged():
    base = seeded_linear(32, 24)
    x = rand(4, 7, 32, seed=2)
    layer = LoRALinear(base, r=4, alpha=8.0)
    assert torch.equal(layer.lora_B, torch.zeros(24, 4))
    assert torch.equal(layer(x), base(x))  # B = 0: the update is exactly zero, not merely small


def test_a_is_initialised_like_a_linear_weight_and_factors_follow_the_base_dtype():
    base = seeded_linear(64, 16, dtype=torch.float64)
    torch.manual_seed(5)
    layer = LoRALinear(base, r=8)
    torch.manual_seed(5)
    reference = nn.Linear(64, 8, dtype=torch.float64).weight  # kaiming_uniform_(a=sqrt(5)) comes first
    assert torch.equal(layer.lora_A, reference)
    assert layer.lora_A.abs().max() <= 1 / math.sqrt(64)  # that init's bound, 1/sqrt(fan_in)
    assert layer.lora_A.dtype == layer.lora_B.dtype == torch.float64
    assert layer.lora_A.shape == (8, 64) and layer.lora_B.shape == (16, 8)
    assert layer.r == 8 and layer.alpha == 16.0 and layer.scaling == 2.0


def test_forward_is_base_plus_scaled_low_rank_update():
    base = seeded_linear(32, 24)
    layer = perturbed(LoRALinear(base, r=4, alpha=6.0))
    x = rand(5, 32, seed=3)
    A, B = layer.lora_A, layer.lora_B
    by_hand = base(x) + 1.5 * (x @ A.T @ B.T)
    assert torch.allclose(layer(x), by_hand, rtol=0, atol=4 * EPS32 * by_hand.abs().max().item())


def merge_tol(layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    """Elementwise float32 bound for |merged(x) - layer(x)|: each path is a sum over in (+ r) products,
    so each is off by at most ~(in + r + 2)·eps times the same sum taken over absolute values."""
    W, b, A, B = layer.base.weight, layer.base.bias, layer.lora_A, layer.lora_B
    magnitude = x.abs() @ (W.abs() + layer.scaling * B.abs() @ A.abs()).T + b.abs()
    return 2 * (layer.in_features + layer.r + 2) * EPS32 * magnitude


def test_merged_layer_equals_the_adapter_and_shares_no_storage():
    base = seeded_linear(32, 24)
    layer = perturbed(LoRALinear(base, r=4, alpha=8.0))
    x = rand(6, 32, seed=4)
    merged = layer.merged()
    assert type(merged) is nn.Linear
    assert merged.weight.dtype == base.weight.dtype and merged.weight.device == base.weight.device
    with torch.no_grad():
        assert ((merged(x) - layer(x)).abs() <= merge_tol(layer, x)).all()
        assert torch.allclose(merged.weight, base.weight + 2.0 * layer.lora_B @ layer.lora_A, atol=1e-5, rtol=0)
        assert torch.equal(merged.bias, base.bias)
        weight_before, bias_before = base.weight.clone(), base.bias.clone()
        merged.weight.add_(1.0)
        merged.bias.add_(1.0)
    assert torch.equal(base.weight, weight_before) and torch.equal(base.bias, bias_before)
    assert not merged.weight.requires_grad  # frozen, like the base it replaces


def test_without_bias_the_merged_layer_has_none():
    layer = perturbed(LoRALinear(seeded_linear(8, 4, bias=False), r=2))
    assert layer.merged().bias is None


def test_only_the_factors_get_gradients_and_a_gets_zero_while_b_is_zero():
    base = seeded_linear(8, 5)
    layer = LoRALinear(base, r=3)
    x = rand(4, 8, seed=6)
    layer(x).pow(2).sum().backward()
    assert base.weight.grad is None and base.bias.grad is None
    # dL/dA = scaling · Bᵀ (dL/dy)ᵀ x, and B = 0 at init: the first step moves B only
    assert torch.equal(layer.lora_A.grad, torch.zeros(3, 8))
    assert layer.lora_B.grad.abs().max() > 0
    with torch.no_grad():
        layer.lora_B -= 0.1 * layer.lora_B.grad
    layer.zero_grad()
    layer(x).pow(2).sum().backward()
    assert layer.lora_A.grad.abs().max() > 0  # once B has moved, A learns too


def test_extra_repr_shows_sizes_rank_and_alpha():
    assert "in_features=8, out_features=5, r=3, alpha=6" in repr(LoRALinear(nn.Linear(8, 5), r=3, alpha=6.0))


# --------------------------------------------------------------------------- a small GPT-shaped model
C, N_HEAD, VOCAB, R = 16, 2, 32, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(C, dim=-1)  # (B, T, 3C) -> 3 x (B, T, C)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = attention(q, k, v, causal=True).transpose(1, 2).reshape(B, T, C)  # (B, H, T, D) -> (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(C), Attention(), nn.LayerNorm(C), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(VOCAB, C)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)  # (B, T) -> (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, VOCAB)


WRAPPED = sorted(f"h.{i}.{name}" for i in range(2) for name in ("attn.c_attn", "attn.c_proj", "mlp.c_proj"))


def tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (4, 9), generator=g)


def test_add_lora_trains_r_times_in_plus_out_per_wrapped_layer_and_keeps_the_output():
    model = TinyGPT()
    idx = tokens()
    with torch.no_grad():
        before = model(idx)
    names = add_lora(model, ("c_attn", "c_proj"), r=R, alpha=8.0)
    assert names == WRAPPED
    sizes = [(C, 3 * C), (C, C), (4 * C, C)] * 2  # (in, out) of each wrapped layer
    assert count_parameters(model, trainable_only=True) == sum(R * (i + o) for i, o in sizes)
    assert count_parameters(model) == count_parameters(TinyGPT()) + sum(R * (i + o) for i, o in sizes)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{n}.lora_{f}" for n in WRAPPED for f in "AB")
    assert isinstance(model.h[0].attn.c_attn, LoRALinear) and type(model.h[0].mlp.c_fc) is nn.Linear
    with torch.no_grad():
        assert torch.equal(model(idx), before)


def test_merge_after_training_gives_plain_linears_with_the_same_output():
    model = TinyGPT()
    add_lora(model, ["c_attn", "c_proj"], r=R, alpha=8.0)
    frozen_before = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    idx = tokens(1)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(model.get_submodule(n).lora_B.abs().max() > 0 for n in WRAPPED)
    assert all(torch.equal(p, frozen_before[n]) for n, p in model.named_parameters() if n in frozen_before)

    with torch.no_grad():
        trained = model(idx)
        assert merge_lora(model) == WRAPPED
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        assert all(type(model.get_submodule(n)) is nn.Linear for n in WRAPPED)
        # two blocks of float32 layers with in <= 64, each merged layer off by a few eps·in relative
        # (see merge_tol); LayerNorm and the residual stream keep activations of order 1
        assert torch.allclose(model(idx), trained, rtol=1e-5, atol=1e-5)
    assert merge_lora(model) == []


def _with_lora():
    model = TinyGPT()
    add_lora(model, ["c_attn"], r=R)
    return model


def _with_conv1d():
    model = TinyGPT()
    model.h[0].attn.c_attn = nn.Conv1d(C, 3 * C, 1)  # like Hugging Face GPT-2's Conv1D c_attn
    model.h[1].attn.c_attn = nn.Conv1d(C, 3 * C, 1)
    return model


# fmt: off
ADD_LORA_REFUSALS = [
    ("model", built(lambda: [nn.Linear(2, 2)]), TypeError, "model must be a torch.nn.Module, got list"),
    ("targets", "c_attn", TypeError,
     "targets must be an iterable of module names such as ('c_attn', 'c_proj'), got 'c_attn'"),
    ("targets", None, TypeError, "targets must be an iterable of module names such as ('c_attn', 'c_proj'), got None"),
    ("targets", ["c_attn", 3], TypeError, "targets must hold only str module names, got ['c_attn', 3]"),
    ("targets", [], ValueError, "targets must name at least one module, e.g. ('c_attn', 'c_proj'), got none"),
    ("r", 0, ValueError, "r must be >= 1, got 0"),
    ("r", 4.0, TypeError, "r must be an int, got float"),
    ("alpha", -1.0, ValueError, "alpha must be a finite number > 0 (the update is scaled by alpha / r), got -1.0"),
    (
        "targets",
        ["q_proj"],
        ValueError,
        (
            "targets ['q_proj'] matched no nn.Linear in the model; its nn.Linear modules are: "
            "h.0.attn.c_attn, h.0.attn.c_proj, h.0.mlp.c_fc, h.0.mlp.c_proj, h.1.attn.c_attn, "
            "h.1.attn.c_proj, h.1.mlp.c_fc, h.1.mlp.c_proj, lm_head"
        ),
    ),
    # add_lora twice: merge_lora first
    (
        "model",
        built(_with_lora),
        ValueError,
        (
            "model already holds LoRA layers (h.0.attn.c_attn, h.1.attn.c_attn): add_lora applies "
            "once, to a model without adapters; name every target in one call, or merge_lora(model) "
            "first"
        ),
    ),
    # the Linear inside an adapter is never wrapped
    (
        "model, targets",
        (built(_with_lora), ["base"]),
        ValueError,
        (
            "model already holds LoRA layers (h.0.attn.c_attn, h.1.attn.c_attn): add_lora applies "
            "once, to a model without adapters; name every target in one call, or merge_lora(model) "
            "first"
        ),
    ),
    (
        "model",
        built(_with_conv1d),
        ValueError,
        (
            "targets ['c_attn'] matched no nn.Linear in the model; its nn.Linear modules are: "
            "h.0.attn.c_proj, h.0.mlp.c_fc, h.0.mlp.c_proj, h.1.attn.c_proj, h.1.mlp.c_fc, "
            "h.1.mlp.c_proj, lm_head; modules with those names exist but are not nn.Linear: "
            "h.0.attn.c_attn (Conv1d), h.1.attn.c_attn (Conv1d)"
        ),
    ),
    (
        "model, targets",
        (built(lambda: nn.Sequential(*[nn.Linear(2, 2) for _ in range(20)])), ["nope"]),
        ValueError,
        (
            "targets ['nope'] matched no nn.Linear in the model; its nn.Linear modules are: 0, 1, 2, "
            "3, 4, 5, 6, 7, 8, 9, 10, 11, ... (8 more)"
        ),
    ),
    (
        "model, targets",
        (built(lambda: nn.ModuleDict({"mha": nn.MultiheadAttention(8, 2)})), ["out_proj"]),
        ValueError,
        (
            "targets matched mha.out_proj, the output projection inside nn.MultiheadAttention, which "
            "LoRALinear cannot wrap"
        ),
    ),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message", rows(ADD_LORA_REFUSALS))
def test_add_lora_refusals_leave_the_model_untouched(argument, bad, error, message):
    model = TinyGPT()
    good = dict(model=model, targets=("c_attn",), r=R, alpha=8.0)
    assert_refuses(add_lora, good, argument, bad, error, message)
    assert all(p.requires_grad for p in model.parameters())
    assert not any(isinstance(m, LoRALinear) for m in model.modules())


def lin():
    return nn.Linear(8, 4)


# fmt: off
LORA_LINEAR_REFUSALS = [
    ("base", built(lambda: nn.Conv1d(8, 4, 1)), TypeError, "base must be a torch.nn.Linear, got Conv1d"),
    ("base", built(lambda: LoRALinear(lin())), TypeError, "base must be a torch.nn.Linear, got LoRALinear"),
    ("r", 0, ValueError, "r must be >= 1, got 0"),
    ("r", True, TypeError, "r must be an int, got bool"),
    ("alpha", 0.0, ValueError, "alpha must be a finite number > 0 (the update is scaled by alpha / r), got 0.0"),
    ("alpha", float("nan"), ValueError,
     "alpha must be a finite number > 0 (the update is scaled by alpha / r), got nan"),
]
# fmt: on
test_lora_linear_refusals = refusal_test(
    LoRALinear, built(lambda: dict(base=lin(), r=8, alpha=16.0)), LORA_LINEAR_REFUSALS
)


# fmt: off
LORA_FORWARD_REFUSALS = [
    ("x", torch.ones(3, 5), ValueError, "x must have shape (..., in_features) = (..., 8), got (3, 5)"),
    ("x", torch.ones(3, 8, dtype=torch.int64), TypeError, not_float("x")),
    ("x", torch.ones(3, 8, dtype=torch.float64), ValueError,
     "x must match the layer's dtype torch.float32 and device cpu, got torch.float64 on cpu"),
    ("x", torch.tensor(1.0), ValueError, "x must have shape (..., in_features) = (..., 8), got ()"),
    ("x", [[1.0] * 8], TypeError, "x must be a torch.Tensor, got list"),
]
# fmt: on
test_lora_forward_refusals = refusal_test(
    built(lambda: LoRALinear(lin())), built(lambda: dict(x=torch.ones(3, 8))), LORA_FORWARD_REFUSALS
)


# fmt: off
MERGE_LORA_REFUSALS = [
    ("model", built(lambda: LoRALinear(lin())), ValueError,
     "model is itself a LoRALinear and cannot be replaced in place; use model.merged()"),
    ("model", "model", TypeError, "model must be a torch.nn.Module, got str"),
]
# fmt: on
test_merge_lora_refusals = refusal_test(merge_lora, built(lambda: dict(model=_with_lora())), MERGE_LORA_REFUSALS)


def test_count_parameters_refuses_a_trainable_only_that_is_not_a_bool():
    with pytest.raises(TypeError, match="trainable_only must be a bool"):
        count_parameters(lin(), trainable_only=1)


def test_count_parameters_counts_all_or_only_trainable_and_shared_tensors_once():
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 10, bias=False))
    assert count_parameters(model) == 40 + 8 + 40
    assert count_parameters(model, trainable_only=True) == 88
    model[2].weight = model[0].weight  # tied input and output embeddings
    assert count_parameters(model) == 48
    model[1].requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == 40
    assert count_parameters(model) == 48
