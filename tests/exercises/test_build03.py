"""Build track 03's checks: each passes its solution, refuses the stub, and names the mistake in
at least three plausible wrong versions; the last step really runs SmolLM2-135M in the learner's
decoder."""

import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import lib.course.exercises.build03 as checks


# --------------------------------------------------------------------------- the solutions
class MyRMSNorm(nn.Module):
    def __init__(self, C, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MySwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, F_ = cfg.n_embd, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, F_, bias=False)
        self.up_proj = nn.Linear(C, F_, bias=False)
        self.down_proj = nn.Linear(F_, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def my_rope(x, base=10000.0):
    B, H, T, D = x.shape
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * theta  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * angles.cos().to(x.dtype) + torch.cat([-x2, x1], dim=-1) * angles.sin().to(x.dtype)


class MyAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, D = cfg.n_embd, cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, D
        self.rope_base = cfg.rope_base
        self.q_proj = nn.Linear(C, cfg.n_head * D, bias=False)
        self.k_proj = nn.Linear(C, cfg.n_kv_head * D, bias=False)
        self.v_proj = nn.Linear(C, cfg.n_kv_head * D, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * D, C, bias=False)

    def heads(self, x):
        B, T, C = x.shape
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, H_kv, D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, H_kv, D).transpose(1, 2)
        return q, k, v

    def attend(self, q, k, v, causal=True, scale=True, expand="interleave"):
        B, H, T, D = q.shape
        g = H // self.n_kv_head
        if expand == "interleave":
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        else:
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        scores = q @ k.transpose(-2, -1) / (math.sqrt(D) if scale else 1.0)
        if causal:
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = scores.softmax(-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))

    def forward(self, x):
        q, k, v = self.heads(x)
        return self.attend(my_rope(q, self.rope_base), my_rope(k, self.rope_base), v)


class MyDecoderBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = MyRMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.self_attn = MyAttention(cfg)
        self.post_attention_layernorm = MyRMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.mlp = MySwiGLU(cfg)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MyDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.model.layers = nn.ModuleList([MyDecoderBlock(cfg) for _ in range(cfg.n_layer)])
        self.model.norm = MyRMSNorm(cfg.n_embd, cfg.rms_norm_eps)

    def hidden(self, idx):
        x = self.model.embed_tokens(idx)
        for block in self.model.layers:
            x = block(x)
        return x

    def forward(self, idx):
        return self.model.norm(self.hidden(idx)) @ self.model.embed_tokens.weight.T


def my_generate(model, idx, max_new_tokens):
    for _ in range(max_new_tokens):
        nxt = model(idx)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


SOLUTIONS = {
    "check_rmsnorm": MyRMSNorm,
    "check_swiglu": MySwiGLU,
    "check_rope": my_rope,
    "check_attention": MyAttention,
    "check_decoder_block": MyDecoderBlock,
    "check_decoder": MyDecoder,
    "check_generate": my_generate,
}


# --------------------------------------------------------------------------- wrong versions: 3.1
class NormNoWeight(MyRMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class NormSubtractsMean(MyRMSNorm):
    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class NormEpsOutside(MyRMSNorm):
    def forward(self, x):
        return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.weight


class NormNoEps(MyRMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight


class NormSums(MyRMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.eps) * self.weight


class NormFixedEps(MyRMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class NormNamedScale(nn.Module):
    def __init__(self, C, eps=1e-5):
        super().__init__()
        self.scale, self.eps = nn.Parameter(torch.ones(C)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


# --------------------------------------------------------------------------- 3.2
class SiluOnUp(MySwiGLU):
    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * F.silu(self.up_proj(x)))


class NoSilu(MySwiGLU):
    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class GeluGate(MySwiGLU):
    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


class SigmoidGate(MySwiGLU):
    def forward(self, x):
        return self.down_proj(torch.sigmoid(self.gate_proj(x)) * self.up_proj(x))


class SwiGLUWithBias(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, F_ = cfg.n_embd, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(C, F_), nn.Linear(C, F_)
        self.down_proj = nn.Linear(F_, C)


class SwiGLUMetaNames(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, F_ = cfg.n_embd, cfg.intermediate_size
        self.w1, self.w3, self.w2 = (
            nn.Linear(C, F_, bias=False),
            nn.Linear(C, F_, bias=False),
            nn.Linear(F_, C, bias=False),
        )


# --------------------------------------------------------------------------- 3.3
def rope_interleaved(x, base=10000.0):
    return checks.rotate(x, base, pairs="interleaved", table="interleaved")


def rope_backwards(x, base=10000.0):
    return checks.rotate(x, base, sign=-1.0)


def rope_no_factor_two(x, base=10000.0):
    return checks.rotate(x, base, exponent=1.0)


def rope_from_one(x, base=10000.0):
    return checks.rotate(x, base, first=1)


def rope_fixed_base(x, base=10000.0):
    return my_rope(x, 10000.0)


def rope_float64(x, base=10000.0):
    return my_rope(x, base).double()


# --------------------------------------------------------------------------- 3.4
class RopeOnV(MyAttention):
    def forward(self, x):
        q, k, v = self.heads(x)
        base = self.rope_base
        return self.attend(my_rope(q, base), my_rope(k, base), my_rope(v, base))


class NoRopeOnK(MyAttention):
    def forward(self, x):
        q, k, v = self.heads(x)
        return self.attend(my_rope(q, self.rope_base), k, v)


class RepeatNotInterleave(MyAttention):
    def forward(self, x):
        q, k, v = self.heads(x)
        base = self.rope_base
        return self.attend(my_rope(q, base), my_rope(k, base), v, expand="repeat")


class NoCausalMask(MyAttention):
    def forward(self, x):
        q, k, v = self.heads(x)
        return self.attend(my_rope(q, self.rope_base), my_rope(k, self.rope_base), v, causal=False)


class NoScale(MyAttention):
    def forward(self, x):
        q, k, v = self.heads(x)
        return self.attend(my_rope(q, self.rope_base), my_rope(k, self.rope_base), v, scale=False)


class FixedRopeBase(MyAttention):
    def forward(self, x):
        q, k, v = self.heads(x)
        return self.attend(my_rope(q), my_rope(k), v)


class KvProjWithHHeads(MyAttention):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)


class DiagonalMasked(MyAttention):
    def forward(self, x):
        q, k, v = self.heads(x)
        q, k = my_rope(q, self.rope_base), my_rope(k, self.rope_base)
        B, H, T, D = q.shape
        g = H // self.n_kv_head
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        itself_too = torch.ones(T, T, dtype=torch.bool).triu(0)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(itself_too, float("-inf"))
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D))


def _with_globals(fn_or_cls, **names):
    """A copy of a solution whose notebook namespace binds `names` differently: what a learner
    has when an earlier step's cell defines a wrong version."""
    if isinstance(fn_or_cls, type):
        body = {k: _with_globals(v, **names) for k, v in vars(fn_or_cls).items() if isinstance(v, types.FunctionType)}
        return type(fn_or_cls.__name__, (fn_or_cls,), body)
    return types.FunctionType(
        fn_or_cls.__code__,
        {**fn_or_cls.__globals__, **names},
        fn_or_cls.__name__,
        fn_or_cls.__defaults__,
        fn_or_cls.__closure__,
    )


AttentionWithWrongRope = _with_globals(MyAttention, my_rope=rope_interleaved)


class MaskAsBuffer(MyAttention):
    """nanoGPT's way: the causal mask kept as a persistent buffer named bias."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.register_buffer("bias", torch.ones(64, 64).tril().view(1, 1, 64, 64))


# --------------------------------------------------------------------------- 3.5
class PostNorm(MyDecoderBlock):
    def forward(self, x):
        x = self.input_layernorm(x + self.self_attn(x))
        return self.post_attention_layernorm(x + self.mlp(x))


class Parallel(MyDecoderBlock):
    def forward(self, x):
        attn = self.self_attn(self.input_layernorm(x))
        return x + attn + self.mlp(self.post_attention_layernorm(x))


class NoMlpResidual(MyDecoderBlock):
    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return self.mlp(self.post_attention_layernorm(x))


class SwappedNorms(MyDecoderBlock):
    def forward(self, x):
        x = x + self.self_attn(self.post_attention_layernorm(x))
        return x + self.mlp(self.input_layernorm(x))


class BlockWithUnweightedNorm(MyDecoderBlock):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.input_layernorm = NormNoWeight(cfg.n_embd, cfg.rms_norm_eps)


class BlockWithRepeatedHeads(MyDecoderBlock):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.self_attn = RepeatNotInterleave(cfg)


# --------------------------------------------------------------------------- 3.6
class NoFinalNorm(MyDecoder):
    def forward(self, idx):
        return self.hidden(idx) @ self.model.embed_tokens.weight.T


class Probabilities(MyDecoder):
    def forward(self, idx):
        return super().forward(idx).softmax(-1)


class UntiedHead(MyDecoder):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx):
        return self.lm_head(self.model.norm(self.hidden(idx)))


class TiedTheHuggingFaceWay(MyDecoder):
    """LlamaForCausalLM's tie: an lm_head sharing the embedding's matrix, saved under both names."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx):
        return self.lm_head(self.model.norm(self.hidden(idx)))


class LastPositionOnly(MyDecoder):
    def forward(self, idx):
        return super().forward(idx)[:, -1]


class NoModelPrefix(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList([MyDecoderBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm = MyRMSNorm(cfg.n_embd, cfg.rms_norm_eps)


class TwoLayersAlways(MyDecoder):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.model.layers = self.model.layers[:2]


class DecoderWithPostNormBlocks(MyDecoder):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.model.layers = nn.ModuleList([PostNorm(cfg) for _ in range(cfg.n_layer)])


# --------------------------------------------------------------------------- 3.7
def generate_first_position(model, idx, max_new_tokens):
    for _ in range(max_new_tokens):
        idx = torch.cat([idx, model(idx)[:, 0].argmax(-1, keepdim=True)], dim=1)
    return idx


def generate_new_only(model, idx, max_new_tokens):
    return my_generate(model, idx, max_new_tokens)[:, idx.shape[1] :]


def generate_last_token_only(model, idx, max_new_tokens):
    for _ in range(max_new_tokens):
        idx = torch.cat([idx, model(idx[:, -1:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def generate_one_too_many(model, idx, max_new_tokens):
    return my_generate(model, idx, max_new_tokens + 1)


def generate_float_ids(model, idx, max_new_tokens):
    return my_generate(model, idx, max_new_tokens).float()


class FixedBaseDecoder(MyDecoder):
    """Correct everywhere except RoPE's base, fixed at 10000: SmolLM2's is 100,000."""

    def __init__(self, cfg):
        super().__init__(cfg)
        for block in self.model.layers:
            block.self_attn.rope_base = 10000.0


generate_into_fixed_base_decoder = _with_globals(my_generate, MyDecoder=FixedBaseDecoder)


WRONG_VERSIONS = {
    "check_rmsnorm": [
        (NormNoWeight, "learned scale"),
        (NormSubtractsMean, "LayerNorm"),
        (NormEpsOutside, "inside the square root"),
        (NormNoEps, "a row of zeros"),
        (NormSums, "mean"),
        (NormFixedEps, "eps given to __init__"),
        (NormNamedScale, "named weight"),
    ],
    "check_swiglu": [
        (SiluOnUp, "gate branch"),
        (NoSilu, "needs its SiLU"),
        (GeluGate, "not GELU"),
        (SigmoidGate, "not sigmoid(x) alone"),
        (SwiGLUWithBias, "bias=False"),
        (SwiGLUMetaNames, "gate_proj, up_proj, down_proj"),
    ],
    "check_rope": [
        (rope_interleaved, "interleaved pairs"),
        (rope_backwards, "wrong way"),
        (rope_no_factor_two, "base^(-2i/D)"),
        (rope_from_one, "start at 0"),
        (rope_fixed_base, "100,000"),
        (rope_float64, "torch.float32 like the input"),
    ],
    "check_attention": [
        (RopeOnV, "q and k only"),
        (NoRopeOnK, "rotate k"),
        (RepeatNotInterleave, "repeat_interleave"),
        (NoCausalMask, "causal mask"),
        (NoScale, "1/√D"),
        (FixedRopeBase, "cfg.rope_base"),
        (KvProjWithHHeads, "H_kv"),
        (DiagonalMasked, "sees itself"),
        (AttentionWithWrongRope, "Step 3.3"),
        (MaskAsBuffer, "persistent=False"),
    ],
    "check_decoder_block": [
        (PostNorm, "post-norm"),
        (Parallel, "not in parallel"),
        (NoMlpResidual, "added to x too"),
        (SwappedNorms, "input_layernorm goes before"),
        (BlockWithUnweightedNorm, "Step 3.1"),
        (BlockWithRepeatedHeads, "Step 3.4"),
    ],
    "check_decoder": [
        (NoFinalNorm, "final norm"),
        (Probabilities, "not probabilities"),
        (UntiedHead, "tied"),
        (TiedTheHuggingFaceWay, "a second time"),
        (LastPositionOnly, "every position"),
        (NoModelPrefix, "self.model"),
        (TwoLayersAlways, "cfg.n_layer"),
        (DecoderWithPostNormBlocks, "Step 3.5"),
    ],
    "check_generate": [
        (generate_first_position, "LAST position"),
        (generate_new_only, "prompt followed by"),
        (generate_last_token_only, "whole sequence so far"),
        (generate_one_too_many, "one token too"),
        (generate_float_ids, "integers"),
        (generate_into_fixed_base_decoder, "Step 3.6"),
    ],
}


# --------------------------------------------------------------------------- beyond the two shapes
def test_generate_check_runs_smollm2_in_the_learners_decoder(capsys):
    """The last step loads SmolLM2-135M's real weights into the notebook's MyDecoder and prints
    its text; a decoder with a fixed RoPE base fails on the real model's case, not before."""
    report = checks.check_generate(my_generate)
    assert report.passed and report.n_cases == 4, report
    out = capsys.readouterr().out
    assert "Once upon a time" in out and "SmolLM2" in out
    report = checks.check_generate(generate_into_fixed_base_decoder)
    assert not report.passed and "SmolLM2" in report.failed_case, report
    assert "logits differ" in report.problem, report


def test_a_generate_without_a_decoder_in_its_notebook_is_told_to_run_step_3_6():
    report = checks.check_generate(_with_globals(my_generate, MyDecoder=None))
    assert not report.passed and "Step 3.6" in report.hint, report


def test_a_module_instance_is_refused_with_a_hint():
    report = checks.check_rmsnorm(MyRMSNorm(8))
    assert not report.passed and "class itself" in report.hint, report


def test_checks_leave_the_global_random_generator_alone():
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    checks.check_attention(MyAttention)
    assert torch.equal(torch.rand(3), before)


def test_the_notebook_is_found_through_a_decorator():
    """A learner may write @torch.no_grad() over their loop: MyDecoder is still found."""
    decorated = torch.no_grad()(_with_globals(my_generate, MyDecoder=FixedBaseDecoder))
    report = checks.check_generate(decorated)
    assert not report.passed and "SmolLM2" in report.failed_case, report


def _stub(self, *args):
    raise NotImplementedError


def test_a_step_built_on_an_earlier_stub_says_which_part_to_write_first():
    """Written 3.5 over an unwritten 3.1 or 3.3: the hint names the earlier part, not this cell."""
    unwritten_norm = type("MyRMSNorm", (MyRMSNorm,), {"__init__": _stub})
    block = _with_globals(MyDecoderBlock, MyRMSNorm=unwritten_norm)
    report = checks.check_decoder_block(block)
    assert report.problem == "not attempted yet", report
    assert "MyRMSNorm, from an earlier step" in report.hint, report

    def unwritten_rope(x, base=10000.0):
        raise NotImplementedError

    report = checks.check_attention(_with_globals(MyAttention, my_rope=unwritten_rope))
    assert report.problem == "not attempted yet", report
    assert "unwritten_rope, from an earlier step" in report.hint, report
    stub_forward = type("MyAttention", (MyAttention,), {"forward": _stub})
    report = checks.check_attention(stub_forward)
    assert report.problem == "not attempted yet" and "replace the" in report.hint, report
