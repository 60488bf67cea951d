"""Checks for build track 03, "a Llama decoder, then SmolLM2-135M in it".

The learner writes a Llama-family decoder part by part (Touvron et al. 2023; grouped-query
attention, Ainslie et al. 2023). Each part is checked against lib.llama's with the same weights
copied in by name: Hugging Face's names, which lib.llama keeps, so that SmolLM2-135M's checkpoint
loads into the learner's model in the last step.

    check_rmsnorm(cls)        MyRMSNorm(C, eps)(x (..., C)) -> (..., C), equal to
                              torch.nn.RMSNorm (the norm lib.llama uses)
    check_swiglu(cls)         MySwiGLU(cfg)(x (B, T, C)) -> (B, T, C), equal to lib.llama.SwiGLU
    check_rope(fn)            my_rope(x (B, H, T, D), base) -> x rotated at positions 0..T-1 with
                              rotate-half pairs, equal to lib.rope.apply_rope_ref
    check_attention(cls)      MyAttention(cfg)(x (B, T, C)) -> (B, T, C): causal grouped-query
                              self-attention, equal to lib.llama.GroupedQueryAttention
    check_decoder_block(cls)  MyDecoderBlock(cfg)(x (B, T, C)) -> (B, T, C), causal, positions
                              0..T-1, equal to lib.llama.LlamaBlock (lesson 08's track reuses it)
    check_decoder(cls)        MyDecoder(cfg)(idx (B, T)) -> logits (B, T, V), equal to
                              lib.llama.Llama
    check_generate(fn)        my_generate(model, idx (B, T), n) -> (B, T + n) greedy tokens, no
                              cache: on lib's tiny Llama, then on the notebook's MyDecoder holding
                              SmolLM2-135M-Instruct's weights, equal to lib.decode.generate's

A later part's check also runs the earlier parts' checks on what it finds inside the learner's
module (or, for a function, in the notebook's namespace), so that a wrong RMSNorm is reported as
Step 3.1's, not as a puzzling block. `cfg` is a lib.llama.LlamaConfig.

The helpers above the checks (building the learner's class, copying weights by name, matching
an answer against plausible mistakes, finding a notebook's earlier parts) serve build04 too.

Glossary: B batch, T tokens, C width, H query heads, H_kv key/value heads, D head dim, F the
SwiGLU hidden width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib.course.exercises import Case, CheckReport, call_learner, run_checks
from lib.decode import generate
from lib.llama import GroupedQueryAttention, Llama, LlamaBlock, LlamaConfig, SwiGLU
from lib.masks import causal_mask
from lib.rope import apply_rope, apply_rope_ref, rope_cos_sin

__all__ = [
    "check_attention",
    "check_decoder",
    "check_decoder_block",
    "check_generate",
    "check_rmsnorm",
    "check_rope",
    "check_swiglu",
]

# fp32 throughout: the learner's parts and lib's do the same sums in other orders (a naive
# softmax against SDPA, rsqrt against 1/sqrt). Measured: they differ by at most 2e-6 on outputs
# of size ~1-10, so 1e-4 leaves a margin for other CPUs and other correct orders; every mistake
# the checks name moves the outputs by 5e-2 or more.
TOL = dict(atol=1e-4, rtol=1e-4)
# a plausible mistake is recognised when the answer equals what it would give, to this tolerance
MISTAKE_TOL = dict(atol=1e-3, rtol=1e-3)

# the configs the parts are checked on: lib's tiny Llama (C = 32, H = 4, H_kv = 2, D = 8, F = 48,
# 2 layers, V = 64), and one with SmolLM2's three query heads per key/value head and its RoPE base
TINY = LlamaConfig.tiny()
WIDE = LlamaConfig.tiny(
    vocab_size=80, n_layer=3, n_embd=48, n_head=6, n_kv_head=2, intermediate_size=40, rope_base=100000.0
)

# the real model's run: SmolLM2-135M-Instruct continues this prompt greedily. Its fp32 logits
# (size ~40) from two correct implementations differ by < 1e-4 (measured ~7e-5 against a float64
# run); the greedy choices win by a margin above 0.15 over the second-best token.
PROMPT, N_NEW = "Once upon a time", 16
SMOL_TOL = dict(atol=1e-3, rtol=1e-4)


# --------------------------------------------------------------------------- shared helpers
def seeded(seed: int, make):
    """make() with torch's global generator seeded (nn.Linear's init draws from it), leaving the
    caller's generator as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def learner_global(obj, name: str):
    """What the learner's notebook binds to `name`, found through the globals of the function
    they passed (or of their class's methods), through decorators; None if nothing."""
    candidates = list(vars(obj).values()) if isinstance(obj, type) else [obj]
    for f in candidates:
        f = inspect.unwrap(f) if callable(f) else f
        if inspect.isfunction(f) and name in f.__globals__:
            return f.__globals__[name]
    return None


def earlier_stub_hint(err: BaseException, own) -> str | None:
    """If a NotImplementedError was raised inside an earlier step's part (not inside `own`, the
    class or function this step writes), a hint that says so."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return None
    frame = tb.tb_frame
    self = frame.f_locals.get("self")
    if self is not None:
        owner, name = type(self), type(self).__name__
        if isinstance(own, type) and issubclass(own, owner):
            return None
    else:
        owner, name = frame.f_code, frame.f_code.co_name
        if owner is getattr(inspect.unwrap(own), "__code__", None):
            return None
    return (
        f"{name}, from an earlier step, is still a stub (it raises NotImplementedError): "
        "write it first, then run this cell again"
    )


def call_part(exercise: str, fn, args: tuple, case: str, n_cases: int, own=None):
    """call_learner, with a hint naming the earlier step's part when a stub other than `own`
    (by default fn itself) raised."""
    if not callable(fn):
        return call_learner(exercise, fn, args, case, n_cases)
    raised = []

    def tracked(*a):
        try:
            return fn(*a)
        except NotImplementedError as err:
            raised.append(err)
            raise

    got, report = call_learner(exercise, tracked, args, case, n_cases)
    if report is not None and raised:
        report.hint = earlier_stub_hint(raised[0], fn if own is None else own) or report.hint
    return got, report


def is_learners(cls) -> bool:
    """Whether a module's class is the learner's own (not torch's or lib's)."""
    return not cls.__module__.startswith(("torch", "lib."))


def build(exercise: str, cls, args: tuple, n_cases: int, what: str):
    """Call the learner's class -> (module, None), or (None, the report saying why not)."""
    case = f"building {what}"
    if isinstance(cls, nn.Module):
        return None, CheckReport(
            exercise,
            False,
            n_cases,
            case,
            "got a module instance, expected the class",
            f"pass the class itself: the check builds {what} with its config",
        )
    with torch.random.fork_rng(devices=[]):  # the learner's init draws: leave their generator be
        module, report = call_part(exercise, cls, args, case, n_cases)
    if report is not None:
        return None, report
    if not isinstance(module, nn.Module):
        return None, CheckReport(
            exercise,
            False,
            n_cases,
            case,
            f"{what} gave a {type(module).__name__}, expected an nn.Module",
            "define it as `class ...(nn.Module)` and call super().__init__() first",
        )
    return module, None


def _names(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


OTHER_NAMES = ("w1", "w2", "w3", "wq", "wk", "wv", "wo", "c_attn", "c_proj", "c_fc")


def _name_hint(module: nn.Module, missing: list[str], unexpected: list[str]) -> str | None:
    """The likeliest reason the learner's parameter names differ from lib's."""
    buffers = {name for name, _ in module.named_buffers()}
    saved = [n for n in unexpected if n in buffers]
    if saved:  # before .bias: nanoGPT (and lib/gpt.py) keep the causal mask as a buffer "bias"
        return (
            f"{saved[0]} is a buffer saved with the weights: the module must hold only its "
            "parameters, since a checkpoint holds nothing else and loads strictly; build the "
            "mask in forward, or register the buffer with persistent=False"
        )
    if any(n.endswith(".bias") or n == "bias" for n in unexpected):
        return "Llama's projections and norms have no bias: nn.Linear(..., bias=False)"
    if "lm_head.weight" in unexpected:
        head = getattr(getattr(module, "lm_head", None), "weight", None)
        embed = getattr(getattr(getattr(module, "model", None), "embed_tokens", None), "weight", None)
        if head is not None and head is embed:
            return (
                "lm_head.weight = embed_tokens.weight ties the two, but the module still "
                "saves that matrix a second time, as lm_head.weight, a name SmolLM2's "
                "checkpoint lacks: drop the lm_head module and compute logits = "
                "model.norm(x) @ model.embed_tokens.weight.T"
            )
        return (
            "the head is tied to the embedding: logits = model.norm(x) @ "
            "model.embed_tokens.weight.T, no lm_head of its own (SmolLM2 has none)"
        )
    if missing == ["weight"] and len(unexpected) <= 1:
        return "keep the learned scale as a parameter named weight: self.weight = nn.Parameter(torch.ones(C))"
    if any(n.startswith(("embed_tokens", "layers.", "norm.")) for n in unexpected):
        return (
            "put the parts under self.model, as Hugging Face's LlamaForCausalLM does: "
            "self.model = nn.Module(); self.model.embed_tokens = ...; names like "
            "model.layers.0.self_attn.q_proj.weight"
        )
    if any(n.split(".")[-2] in OTHER_NAMES for n in unexpected if "." in n):
        return (
            "those are another codebase's names: this course and Hugging Face call them "
            "q_proj, k_proj, v_proj, o_proj (attention) and gate_proj, up_proj, down_proj "
            "(SwiGLU)"
        )
    layers = [{n.split(".")[2] for n in names if n.startswith("model.layers.")} for names in (missing, unexpected)]
    if layers[0] and not layers[1]:
        return "build cfg.n_layer blocks (this config has more layers than the one you planned for)"
    if len(missing) == len(unexpected) == 1:
        return f"rename {unexpected[0]} to {missing[0]}, the name lib and Hugging Face's checkpoints use"
    return None


def copy_weights(
    exercise: str, module: nn.Module, reference: nn.Module, n_cases: int, case: str, shape_hint=None
) -> CheckReport | None:
    """Copy lib's weights into the learner's module by name; a report if names or shapes differ."""
    ours, theirs = reference.state_dict(), module.state_dict()
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or unexpected:
        parts = [f"missing {_names(missing)}"] if missing else []
        parts += [f"unexpected {_names(unexpected)}"] if unexpected else []
        hint = _name_hint(module, missing, unexpected) or (
            "use lib's names (Hugging Face's, so that real checkpoints load by name): " + _names(sorted(ours), 12)
        )
        return CheckReport(
            exercise, False, n_cases, case, "parameter names differ from lib's: " + "; ".join(parts), hint
        )
    for name, value in ours.items():
        if theirs[name].shape != value.shape:
            hint = shape_hint(name, tuple(theirs[name].shape)) if shape_hint else None
            return CheckReport(
                exercise,
                False,
                n_cases,
                case,
                f"{name} has shape {tuple(theirs[name].shape)}, expected {tuple(value.shape)}",
                hint or "nn.Linear(n_in, n_out) stores its weight as (n_out, n_in)",
            )
    with torch.no_grad():
        module.load_state_dict(ours)
    return None


def _matches(got: torch.Tensor, value: torch.Tensor | None, tol: dict) -> bool:
    if value is None or value.shape != got.shape:
        return False
    if got.is_floating_point():
        return torch.allclose(got, value.to(got.dtype), equal_nan=True, **tol)
    return torch.equal(got, value.to(got.dtype))


def first_hint(got: torch.Tensor, variants, tol=None, expected: torch.Tensor | None = None) -> str | None:
    """The hint of the first (what that mistake gives, hint) pair that `got` matches, skipping the
    mistakes this case cannot tell from the right answer (no mask when T = 1, say)."""
    tol = tol or MISTAKE_TOL
    if expected is not None and got.dtype != expected.dtype and got.shape == expected.shape:
        return f"return {expected.dtype} like the input (compute in another dtype if you like, then convert back)"
    for value, hint in variants:
        if _matches(got, value, tol) and not (expected is not None and _matches(expected, value, tol)):
            return hint
    return None


def upstream_hint(checks) -> str | None:
    """checks: (step, the learner's earlier part or None, its check); the first that fails, as
    a hint pointing back to its step."""
    for step, part, check in checks:
        if part is None:
            continue
        report = check(part)
        if not report.passed:
            name = getattr(part, "__name__", "part")
            return (
                f"your {name} from Step {step} does not pass its own check yet ({report.problem}): fix it there first"
            )
    return None


def module_cases(
    exercise: str,
    cls,
    specs,
    make_reference,
    construct_args,
    forward,
    what: str,
    shape_hint=None,
    diagnose=None,
    nan_hint=None,
) -> CheckReport:
    """Build the learner's module for each spec (name, cfg, inputs), copy lib's weights in, and
    compare its forward with lib's: `forward(module, cfg, *inputs)` runs either module;
    `diagnose(module, reference, cfg, inputs, expected)` makes a case's hint function."""
    n = len(specs)
    cases, modules = [], []
    for i, (name, cfg, inputs) in enumerate(specs):
        reference = make_reference(cfg, i)
        module, report = build(exercise, cls, construct_args(cfg), n, what)
        if report is not None:
            return report
        report = copy_weights(exercise, module, reference, n, f"{name}: copying lib's weights into {what}", shape_hint)
        if report is not None:
            return report
        with torch.no_grad():
            expected = forward(reference, cfg, *inputs)
        modules.append((module, cfg))
        hint = None if diagnose is None else diagnose(module, reference, cfg, inputs, expected)
        cases.append(Case(name, (i, *inputs), expected, diagnose=hint, **TOL))

    stubs = []

    def learner(i, *inputs):
        module, cfg = modules[i]
        try:
            with torch.no_grad():
                return forward(module, cfg, *inputs)
        except NotImplementedError as err:
            stubs.append(err)
            raise

    report = run_checks(exercise, learner, cases, nan_hint=nan_hint)
    if stubs and report.problem == "not attempted yet":
        report.hint = earlier_stub_hint(stubs[-1], cls) or report.hint
    return report


def randomised(module: nn.Module, seed: int) -> nn.Module:
    """Norm weights away from one (a forgotten weight then shows) and projections twice their
    initial size (attention far from uniform, so a missing mask or scale shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "embed" not in name:
                p.mul_(2.0)
    return module


def tiny_llama(cfg: LlamaConfig, seed: int, std: float = 0.2) -> Llama:
    """lib's Llama with normal(0, std) weights and norm weights near one, in eval mode."""

    def make():
        model = Llama(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, std) if p.dim() == 2 else p.copy_(1 + 0.3 * torch.randn(p.shape))
        return model.eval()

    return seeded(seed, make)


def _x(seed: int, *shape) -> torch.Tensor:
    """Random inputs, often negative (SiLU's gate differs from ReLU's there)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) - 0.2


def _attention_nan_hint(case) -> str:
    return (
        "NaN after the softmax: a row whose keys are all masked? Mask only the keys after the "
        "query (triu(diagonal=1)): a token always sees itself"
    )


# --------------------------------------------------------------------------- 3.1 RMSNorm
def _diagnose_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, expected: torch.Tensor):
    ms = x.pow(2).mean(-1, keepdim=True)
    centred = x - x.mean(-1, keepdim=True)
    fixed_eps = "use the eps given to __init__ (it differs between models), not a fixed {}"
    variants = [
        (
            x * torch.rsqrt(ms + eps),
            "the learned scale is missing: multiply by self.weight (C values, one per channel)",
        ),
        (
            centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w,
            "that is LayerNorm: RMSNorm subtracts no mean (and adds no bias); divide x by sqrt(mean(x²) + eps)",
        ),
        (
            x * torch.rsqrt(x.var(-1, keepdim=True) + eps) * w,
            "divide by the root mean square of x, not by its standard deviation",
        ),
        (x / (ms.sqrt() + eps) * w, "eps goes inside the square root: x / sqrt(mean(x²) + eps)"),
        (x * torch.rsqrt(ms) * w, "eps is missing: x / sqrt(mean(x²) + eps) keeps a near-zero vector finite"),
        (
            x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w,
            "average the squares over the C channels (mean), don't sum them",
        ),
        (
            x * torch.rsqrt(x.pow(2).mean() + eps) * w,
            "normalise each vector over its own C channels: x.pow(2).mean(-1, keepdim=True), not over the whole tensor",
        ),
        (x * torch.rsqrt(ms + 1e-5) * w if eps != 1e-5 else None, fixed_eps.format("1e-5")),
        (x * torch.rsqrt(ms + 1e-6) * w if eps != 1e-6 else None, fixed_eps.format("1e-6")),
    ]
    # the learner's fp32 sums against ours: 1e-5 separates eps = 1e-5 from no eps on unit inputs
    return lambda got: first_hint(got, variants, dict(atol=1e-5, rtol=1e-4), expected)


def check_rmsnorm(cls) -> CheckReport:
    """MyRMSNorm(C, eps) with a parameter `weight` (C,); forward x (..., C) ->
    x / sqrt(mean(x²) + eps) * weight over the last dim."""
    zero_row = _x(1, 4, 8) - 1.0
    zero_row[1] = 0.0
    specs = [
        ("x (2, 3, 8) with a learned scale, eps = 1e-5", (8, 1e-5), (_x(0, 2, 3, 8) + 0.7,)),
        ("a row of zeros (eps keeps it finite) among negative rows", (8, 1e-5), (zero_row,)),
        ("small inputs (|x| ~ 0.003) and eps = 1e-4: where eps matters", (16, 1e-4), (0.003 * _x(2, 3, 16),)),
        ("large values (|x| ~ 100), C = 16, eps = 1e-6", (16, 1e-6), (100 * _x(3, 1, 5, 16),)),
    ]

    def make_reference(cfg, i):
        C, eps = cfg
        norm = nn.RMSNorm(C, eps=eps)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.5 * torch.randn(C, generator=torch.Generator().manual_seed(i)))
        return norm

    def diagnose(module, reference, cfg, inputs, expected):
        return _diagnose_rmsnorm(inputs[0], reference.weight.detach(), cfg[1], expected)

    def nan_hint(case):
        return "a row of zeros gives 0/0: add eps inside the square root, x / sqrt(mean(x²) + eps)"

    return module_cases(
        "Step 3.1 (RMSNorm)",
        cls,
        specs,
        make_reference,
        lambda cfg: cfg,
        lambda m, cfg, x: m(x),
        "MyRMSNorm(C, eps)",
        diagnose=diagnose,
        nan_hint=nan_hint,
    )


# --------------------------------------------------------------------------- 3.2 SwiGLU
def _diagnose_swiglu(mlp: SwiGLU, x: torch.Tensor, expected: torch.Tensor):
    with torch.no_grad():
        g, u, down = mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj
        variants = [
            (down(g * F.silu(u)), "SiLU belongs on the gate branch: down(silu(gate(x)) * up(x)); you put it on up"),
            (down(g * u), "the gate needs its SiLU: down(silu(gate(x)) * up(x))"),
            (down(F.gelu(g) * u), "SwiGLU's gate is SiLU, x·sigmoid(x) (F.silu), not GELU"),
            (down(torch.sigmoid(g) * u), "SiLU is x·sigmoid(x), not sigmoid(x) alone (a sigmoid gate is GLU's)"),
            (down(F.relu(g) * u), "SwiGLU's gate is SiLU (F.silu), not ReLU"),
            (down(F.silu(g * u)), "apply SiLU to the gate alone, then multiply by up(x): down(silu(gate(x)) * up(x))"),
            (down(F.silu(g) + u), "the two branches multiply, they don't add: silu(gate(x)) * up(x)"),
        ]
    return lambda got: first_hint(got, variants, expected=expected)


def _swiglu_shape_hint(name: str, shape: tuple) -> str:
    if name.startswith(("gate_proj", "up_proj")):
        return "gate_proj and up_proj go from C to F = cfg.intermediate_size: nn.Linear(C, F), whose weight is (F, C)"
    return "down_proj goes back from F to C: nn.Linear(F, C), whose weight is (C, F)"


def check_swiglu(cls) -> CheckReport:
    """MySwiGLU(cfg) with gate_proj, up_proj (C -> F) and down_proj (F -> C), no biases; forward
    x (B, T, C) -> down_proj(silu(gate_proj(x)) * up_proj(x))."""
    specs = [
        ("x (2, 5, C = 32), F = 48", TINY, (2 * _x(20, 2, 5, 32),)),
        ("one token, C = 48, F = 40", WIDE, (2 * _x(21, 1, 1, 48),)),
        ("x (3, 4, C = 32), mostly negative", TINY, (2 * _x(22, 3, 4, 32) - 1.0,)),
    ]

    def make_reference(cfg, i):
        return randomised(seeded(30 + i, lambda: SwiGLU(cfg)), 40 + i)

    def diagnose(module, reference, cfg, inputs, expected):
        return _diagnose_swiglu(reference, inputs[0], expected)

    return module_cases(
        "Step 3.2 (the SwiGLU feed-forward)",
        cls,
        specs,
        make_reference,
        lambda cfg: (cfg,),
        lambda m, cfg, x: m(x),
        "MySwiGLU(cfg)",
        shape_hint=_swiglu_shape_hint,
        diagnose=diagnose,
    )


# --------------------------------------------------------------------------- 3.3 RoPE
def rotate(
    x: torch.Tensor,
    base: float,
    *,
    first: int = 0,
    pairs: str = "half",
    table: str = "half",
    sign: float = 1.0,
    exponent: float = 2.0,
) -> torch.Tensor:
    """RoPE and its plausible misreadings, computed in float64: x (B, H, T, D) rotated at
    positions first..first+T-1 by the angles p·base^(-exponent·i/D)."""
    B, H, T, D = x.shape
    theta = base ** (-exponent * torch.arange(D // 2, dtype=torch.float64) / D)  # (D/2,)
    angles = torch.arange(first, first + T, dtype=torch.float64)[:, None] * theta  # (T, D/2)
    if table == "half":
        angles = torch.cat([angles, angles], -1)  # (T, D/2) -> (T, D)
    else:
        angles = angles.repeat_interleave(2, -1)
    x64 = x.double()
    if pairs == "half":
        x1, x2 = x64.chunk(2, dim=-1)
        turned = torch.cat([-x2, x1], dim=-1)
    else:
        turned = torch.stack([-x64[..., 1::2], x64[..., ::2]], dim=-1).reshape(x.shape)
    return (x64 * angles.cos() + sign * turned * angles.sin()).to(x.dtype)


def _diagnose_rope(x: torch.Tensor, base: float, expected: torch.Tensor):
    variants = [
        (x, "the output equals the input: rotate each pair (i, i + D/2) by the angle position · θ_i"),
        (
            rotate(x, base, pairs="interleaved", table="interleaved"),
            "those are the paper's interleaved pairs (2i, 2i + 1); Hugging Face's Llama, SmolLM2 and "
            "lib pair channel i with channel i + D/2: rotate_half(x) = cat(-x2, x1) on the halves",
        ),
        (
            rotate(x, base, table="interleaved"),
            "the angle table is repeat-interleaved: channel i pairs with i + D/2, so concatenate "
            "the (T, D/2) angles with themselves, cat([a, a], -1)",
        ),
        (
            rotate(x, base, sign=-1.0),
            "rotated the wrong way: x·cos + rotate_half(x)·sin with rotate_half(x) = cat(-x2, x1)",
        ),
        (
            rotate(x, base, exponent=1.0),
            "θ_i = base^(-2i/D) for i = 0 .. D/2 - 1: torch.arange(0, D, 2) / D, not arange(D // 2) / D",
        ),
        (rotate(x, base, first=1), "positions start at 0: the first token is not rotated"),
        (
            rotate(x, 10000.0) if base != 10000.0 else None,
            "use the base passed in (SmolLM2's is 100,000), not a fixed 10000",
        ),
    ]
    return lambda got: first_hint(got, variants, expected=expected)


def check_rope(fn) -> CheckReport:
    """fn(x (B, H, T, D), base) -> x with each channel pair (i, i + D/2) at position t rotated
    by t·θ_i, θ_i = base^(-2i/D), t = 0..T-1."""
    g = torch.Generator().manual_seed(50)
    cases = []
    for name, shape, base in [
        ("one position (T = 1): position 0 is not rotated", (1, 1, 1, 8), 10000.0),
        ("positions 0..5, B = 2, H = 2, D = 8", (2, 2, 6, 8), 10000.0),
        ("SmolLM2's base 100,000, H = 3, T = 9, D = 16", (1, 3, 9, 16), 100000.0),
        ("a longer sequence: T = 40, D = 4", (1, 1, 40, 4), 10000.0),
    ]:
        x = torch.randn(*shape, generator=g)
        # fp32 against a float64 rotation: fp32 tables round the angles' cos and sin by ~1e-7
        expected = apply_rope_ref(x, torch.arange(shape[2]), base)
        cases.append(Case(name, (x.clone(), base), expected, diagnose=_diagnose_rope(x, base, expected), **TOL))
    return run_checks("Step 3.3 (RoPE)", fn, cases)


# --------------------------------------------------------------------------- 3.4 attention
def gqa_variant(
    att: nn.Module,
    x: torch.Tensor,
    base: float,
    *,
    rope: str = "qk",
    expand: str = "interleave",
    causal: bool = True,
    scale: bool = True,
    split: str = "heads",
) -> torch.Tensor:
    """Grouped-query self-attention with lib's projections `att`, and its plausible mistakes:
    RoPE on other tensors, KV heads repeated instead of interleaved, no mask, no scale, heads
    split with a plain view."""
    B, T, C = x.shape
    H, H_kv, D = att.n_head, att.n_kv_head, att.head_dim

    def heads(t, n):  # (B, T, n·D) -> (B, n, T, D)
        return t.view(B, T, n, D).transpose(1, 2) if split == "heads" else t.view(B, n, T, D)

    q, k, v = heads(att.q_proj(x), H), heads(att.k_proj(x), H_kv), heads(att.v_proj(x), H_kv)
    cos, sin = rope_cos_sin(T, D, base=base)
    q, k, v = (apply_rope(t, cos, sin) if name in rope else t for name, t in zip("qkv", (q, k, v)))
    if expand == "interleave":  # (B, H_kv, T, D) -> (B, H, T, D)
        k, v = k.repeat_interleave(H // H_kv, dim=1), v.repeat_interleave(H // H_kv, dim=1)
    else:
        k, v = k.repeat(1, H // H_kv, 1, 1), v.repeat(1, H // H_kv, 1, 1)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(D) if scale else 1.0)  # (B, H, T, T)
    if causal:
        scores = scores + causal_mask(T)
    y = scores.softmax(-1) @ v  # (B, H, T, D)
    y = y.transpose(1, 2).reshape(B, T, H * D) if split == "heads" else y.reshape(B, T, H * D)
    return att.o_proj(y)


def _diagnose_attention(cls, reference, cfg, x, expected):
    base = cfg.rope_base
    both = "only then does a score depend on the offset between the two positions"
    with torch.no_grad():
        variants = [
            (
                gqa_variant(reference, x, base, rope="qkv"),
                "RoPE rotates q and k only: v carries what a token says, not where it is",
            ),
            (gqa_variant(reference, x, base, rope="q"), f"rotate k as well as q: {both}"),
            (gqa_variant(reference, x, base, rope="k"), f"rotate q as well as k: {both}"),
            (
                gqa_variant(reference, x, base, rope=""),
                "no RoPE: apply my_rope to q and k (after splitting the heads, before the scores)",
            ),
            (
                gqa_variant(reference, x, base, expand="repeat"),
                "KV head j serves the query heads j·H/H_kv .. (j+1)·H/H_kv - 1 (the layout of "
                "SmolLM2's weights): repeat_interleave(H // H_kv, dim=1); .repeat cycles through "
                "the KV heads instead",
            ),
            (
                gqa_variant(reference, x, base, causal=False),
                "no causal mask: query t must not see the keys after t (-inf above the diagonal)",
            ),
            (gqa_variant(reference, x, base, scale=False), "scale the scores by 1/√D, D the head dim"),
            (
                gqa_variant(reference, x, base, split="flat"),
                "split the heads with view(B, T, H, D).transpose(1, 2): a plain view(B, H, T, D) "
                "mixes tokens and heads",
            ),
            (
                gqa_variant(reference, x, 10000.0) if base != 10000.0 else None,
                "use cfg.rope_base (SmolLM2's is 100,000), not a fixed 10000",
            ),
        ]

    def diagnose(got: torch.Tensor) -> str | None:
        B, T, C = x.shape
        if got.shape == (B, cfg.n_head, T, cfg.head_dim):
            return "merge the heads and project back: y.transpose(1, 2).reshape(B, T, H·D), then o_proj"
        return upstream_hint([("3.3", learner_global(cls, "my_rope"), check_rope)]) or first_hint(
            got, variants, expected=expected
        )

    return diagnose


def _attention_shape_hint(name: str, shape: tuple) -> str:
    if name.startswith(("k_proj", "v_proj")):
        return (
            "k_proj and v_proj make H_kv = cfg.n_kv_head heads: nn.Linear(C, H_kv·D, bias=False); only q_proj makes H"
        )
    return "q_proj makes H = cfg.n_head heads of D = cfg.head_dim: nn.Linear(C, H·D); o_proj maps H·D back to C"


def check_attention(cls) -> CheckReport:
    """MyAttention(cfg) with q_proj (C -> H·D), k_proj, v_proj (C -> H_kv·D), o_proj
    (H·D -> C), no biases; forward x (B, T, C) -> (B, T, C): q and k rotated by my_rope at
    positions 0..T-1, each KV head shared by H / H_kv query heads (repeat_interleave), causal
    softmax(qkᵀ/√D)v, o_proj."""
    specs = [
        ("one token (T = 1): it attends only to itself", TINY, (_x(60, 1, 1, 32),)),
        ("B = 2, T = 7: H = 4 query heads share H_kv = 2 KV heads", TINY, (_x(61, 2, 7, 32),)),
        ("three query heads per KV head (as SmolLM2's 9 / 3), RoPE base 100,000, T = 5", WIDE, (_x(62, 1, 5, 48),)),
    ]

    def make_reference(cfg, i):
        return randomised(seeded(70 + i, lambda: GroupedQueryAttention(cfg)), 80 + i)

    def forward(module, cfg, x):
        if isinstance(module, GroupedQueryAttention):
            return module(x, rope=rope_cos_sin(x.shape[1], cfg.head_dim, base=cfg.rope_base))
        return module(x)

    def diagnose(module, reference, cfg, inputs, expected):
        return _diagnose_attention(cls, reference, cfg, inputs[0], expected)

    return module_cases(
        "Step 3.4 (grouped-query self-attention)",
        cls,
        specs,
        make_reference,
        lambda cfg: (cfg,),
        forward,
        "MyAttention(cfg)",
        shape_hint=_attention_shape_hint,
        diagnose=diagnose,
        nan_hint=_attention_nan_hint,
    )


# --------------------------------------------------------------------------- 3.5 the block
def _diagnose_block(module: nn.Module, block: LlamaBlock, cfg: LlamaConfig, x: torch.Tensor, expected: torch.Tensor):
    rope = rope_cos_sin(x.shape[1], cfg.head_dim, base=cfg.rope_base)
    with torch.no_grad():
        A = lambda h: block.self_attn(h, rope=rope)  # noqa: E731
        M, n1, n2 = block.mlp, block.input_layernorm, block.post_attention_layernorm
        post = n1(x + A(x))
        after_attn = x + A(n1(x))
        swapped = x + A(n2(x))
        normed = n1(x) + A(n1(x))
        variants = [
            (
                n2(post + M(post)),
                "that is post-norm (the original Transformer, BERT): Llama normalises each branch's "
                "input and adds the branch to the raw x, x = x + attn(norm(x))",
            ),
            (
                M(n2(A(n1(x)))),
                "add each branch to the residual stream: x = x + self_attn(input_layernorm(x)), "
                "then x = x + mlp(post_attention_layernorm(x))",
            ),
            (M(n2(after_attn)), "the MLP's output is added to x too: x = x + mlp(post_attention_layernorm(x))"),
            (A(n1(x)) + M(n2(A(n1(x)))), "the attention's output is added to x: x = x + self_attn(input_layernorm(x))"),
            (
                x + A(n1(x)) + M(n2(x)),
                "the MLP reads x after the attention's update (one branch after the other, not in parallel as GPT-J)",
            ),
            (
                swapped + M(n1(swapped)),
                "input_layernorm goes before the attention, post_attention_layernorm before the MLP",
            ),
            (after_attn + M(n1(after_attn)), "each branch has its own norm: post_attention_layernorm before the MLP"),
            (normed + M(n2(normed)), "add the branch to x itself, not to the normalised x"),
        ]
    parts = [
        ("input_layernorm", "3.1", check_rmsnorm),
        ("post_attention_layernorm", "3.1", check_rmsnorm),
        ("mlp", "3.2", check_swiglu),
        ("self_attn", "3.4", check_attention),
    ]

    def learners_parts():
        for attr, step, check in parts:
            sub = getattr(module, attr, None)
            yield step, (type(sub) if sub is not None and is_learners(type(sub)) else None), check

    def diagnose(got: torch.Tensor) -> str | None:
        return upstream_hint(learners_parts()) or first_hint(got, variants, expected=expected)

    return diagnose


def check_decoder_block(cls) -> CheckReport:
    """MyDecoderBlock(cfg) with input_layernorm, self_attn, post_attention_layernorm, mlp;
    forward x (B, T, C) -> (B, T, C): x + self_attn(input_layernorm(x)), then
    + mlp(post_attention_layernorm(x))."""
    specs = [
        ("one token (T = 1)", TINY, (_x(90, 1, 1, 32),)),
        ("B = 2, T = 6", TINY, (_x(91, 2, 6, 32),)),
        ("C = 48, 6 query / 2 KV heads, RoPE base 100,000, T = 5", WIDE, (_x(92, 1, 5, 48),)),
    ]

    def make_reference(cfg, i):
        return randomised(seeded(100 + i, lambda: LlamaBlock(cfg)), 110 + i)

    def forward(module, cfg, x):
        if isinstance(module, LlamaBlock):
            return module(x, rope=rope_cos_sin(x.shape[1], cfg.head_dim, base=cfg.rope_base))
        return module(x)

    def shape_hint(name, shape):
        return _attention_shape_hint(name[len("self_attn.") :], shape) if name.startswith("self_attn.") else None

    def diagnose(module, reference, cfg, inputs, expected):
        return _diagnose_block(module, reference, cfg, inputs[0], expected)

    return module_cases(
        "Step 3.5 (the decoder block)",
        cls,
        specs,
        make_reference,
        lambda cfg: (cfg,),
        forward,
        "MyDecoderBlock(cfg)",
        shape_hint=shape_hint,
        diagnose=diagnose,
        nan_hint=_attention_nan_hint,
    )


# --------------------------------------------------------------------------- 3.6 the decoder
def _hidden(model: Llama, idx: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """lib's decoder up to (not including) the final norm: (B, T, C)."""
    T = idx.shape[1]
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    x = model.model.embed_tokens(idx) * scale
    for block in model.model.layers:
        x = block(x, rope=rope)
    return x


def _diagnose_decoder(module: nn.Module, model: Llama, idx: torch.Tensor, expected: torch.Tensor):
    W, norm = model.model.embed_tokens.weight, model.model.norm
    with torch.no_grad():
        variants = [
            (_hidden(model, idx) @ W.T, "apply the final norm (model.norm) before the head"),
            (expected.softmax(-1), "return the logits themselves, not probabilities (no softmax)"),
            (expected.log_softmax(-1), "return the logits themselves, not log-probabilities"),
            (
                norm(_hidden(model, idx, math.sqrt(model.config.n_embd))) @ W.T,
                "Llama does not scale the embedding by √C (GPT-2 doesn't either; Gemma does)",
            ),
            (norm(model.model.embed_tokens(idx)) @ W.T, "run x through every block in model.layers"),
        ]

    def diagnose(got: torch.Tensor) -> str | None:
        B, T = idx.shape
        if got.shape == (B, model.config.vocab_size):
            return "return the logits at every position, (B, T, V): generation reads the last, training all of them"
        layers = getattr(getattr(module, "model", None), "layers", None)
        block = type(layers[0]) if isinstance(layers, nn.ModuleList) and len(layers) else None
        block = block if block is not None and is_learners(block) else None
        return upstream_hint([("3.5", block, check_decoder_block)]) or first_hint(got, variants, expected=expected)

    return diagnose


def check_decoder(cls) -> CheckReport:
    """MyDecoder(cfg) with model.embed_tokens, model.layers (cfg.n_layer MyDecoderBlocks),
    model.norm and a head tied to the embedding; forward idx (B, T) -> logits (B, T, V)."""
    g = torch.Generator().manual_seed(120)
    specs = [
        ("one token (B = 1, T = 1)", TINY, (torch.randint(64, (1, 1), generator=g),)),
        ("B = 2, T = 9", TINY, (torch.randint(64, (2, 9), generator=g),)),
        (
            "3 layers, C = 48, 6 query / 2 KV heads, RoPE base 100,000, V = 80, T = 5",
            WIDE,
            (torch.randint(80, (1, 5), generator=g),),
        ),
    ]

    def diagnose(module, reference, cfg, inputs, expected):
        return _diagnose_decoder(module, reference, inputs[0], expected)

    return module_cases(
        "Step 3.6 (the whole decoder)",
        cls,
        specs,
        lambda cfg, i: tiny_llama(cfg, 130 + i),
        lambda cfg: (cfg,),
        lambda m, cfg, idx: m(idx),
        "MyDecoder(cfg)",
        diagnose=diagnose,
        nan_hint=_attention_nan_hint,
    )


# --------------------------------------------------------------------------- 3.7 SmolLM2
@lru_cache(maxsize=1)
def smollm2_run():
    """SmolLM2-135M-Instruct in float32, its tokenizer, the prompt's ids (1, T), lib's greedy
    tokens (1, T + N_NEW) and the uncached logits (1, T + N_NEW - 1, V) that chose them; loaded
    once per process (about 3 s)."""
    from lib.smollm2 import encode, load_smollm2

    model, tokenizer = load_smollm2(dtype=torch.float32)
    idx = encode(PROMPT)
    tokens = generate(model, idx, N_NEW, temperature=0.0)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    return model, tokenizer, idx, tokens, logits


def _loop_variant(
    model: nn.Module, idx: torch.Tensor, n: int, *, position: int = -1, window: int | None = None
) -> torch.Tensor:
    """A greedy loop with a plausible mistake: read another position's logits, or feed only the
    last `window` tokens."""
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx if window is None else idx[:, -window:])
            idx = torch.cat([idx, logits[:, position].argmax(-1, keepdim=True)], dim=1)
    return idx


def _diagnose_loop(model: nn.Module, idx: torch.Tensor, n: int, expected: torch.Tensor):
    B, T = idx.shape
    variants = [
        (
            _loop_variant(model, idx, n, position=0),
            "the next token comes from the logits at the LAST position, logits[:, -1], not the first",
        ),
        (
            _loop_variant(model, idx, n, window=1),
            "without a cache the model sees only what you feed it: run it on the whole sequence so "
            "far at every step, not just the newest token",
        ),
    ]

    def diagnose(got: torch.Tensor) -> str | None:
        if got.dim() == 2 and got.shape == (B, n):
            return "return the prompt followed by the new tokens: torch.cat([idx, new], dim=1), (B, T + n)"
        if got.dim() == 2 and got.shape[0] == B and abs(got.shape[1] - (T + n)) == 1:
            return "one token too many or too few: exactly max_new_tokens new tokens, one per model call"
        if got.is_floating_point():
            return "token ids are integers: keep argmax's int64 (torch.long), not floats"
        return first_hint(got, variants, expected=expected) or (
            "greedy decoding: at each step append argmax(model(idx)[:, -1], dim=-1) to idx (no sampling)"
        )

    return diagnose


def _smollm2_in(exercise: str, fn, learner, n_cases: int) -> CheckReport:
    """The last cases: SmolLM2-135M's weights in the notebook's MyDecoder, its logits and the
    learner's loop's tokens against lib's."""
    case = f"SmolLM2-135M-Instruct's weights in your MyDecoder, {PROMPT!r} + {N_NEW} tokens"
    decoder_cls = learner_global(fn, "MyDecoder")
    if decoder_cls is None:
        return CheckReport(
            exercise,
            False,
            n_cases,
            case,
            "no MyDecoder in this notebook",
            "run Step 3.6's cell first: this check builds your MyDecoder with SmolLM2's config and loads its weights",
        )
    model, tokenizer, idx, tokens, logits = smollm2_run()
    mine, report = build(exercise, decoder_cls, (model.config,), n_cases, "MyDecoder(cfg) with SmolLM2's config")
    report = report or copy_weights(exercise, mine, model, n_cases, case)
    if report is not None:
        return report
    mine.eval()

    def logits_of(ids):
        with torch.no_grad():
            return mine(ids)

    got, report = call_learner(exercise, logits_of, (tokens[:, :-1],), case, n_cases)
    if report is not None:
        return report
    same_shape = isinstance(got, torch.Tensor) and got.shape == logits.shape
    if not (same_shape and torch.allclose(got, logits, **SMOL_TOL)):
        tiny = check_decoder(decoder_cls)
        hint = (
            f"your MyDecoder does not pass Step 3.6's check yet ({tiny.problem}): fix it there first"
            if not tiny.passed
            else "your MyDecoder passes on the tiny configs but not with SmolLM2's: is a value "
            "fixed for the tiny model? SmolLM2 has 30 layers, width 576, 9 query and 3 "
            "key/value heads of dimension 64, RoPE base 100,000 and eps 1e-5: read them all "
            "from cfg"
        )
        diff = f" (largest difference {(got - logits).abs().max().item():.3g})" if same_shape else ""
        return CheckReport(
            exercise, False, n_cases, case, "your MyDecoder's logits differ from lib's SmolLM2" + diff, hint
        )
    got, report = call_learner(exercise, learner, (mine, idx.clone(), N_NEW), case, n_cases)
    if report is not None:
        return report
    if not (isinstance(got, torch.Tensor) and got.shape == tokens.shape and torch.equal(got.long(), tokens)):
        return CheckReport(
            exercise,
            False,
            n_cases,
            case,
            "your loop's tokens differ from lib.decode.generate's",
            "greedy decoding: at each step append argmax(model(idx)[:, -1], dim=-1)",
        )
    print(
        f"Your decoder, holding SmolLM2-135M-Instruct's weights, continues {PROMPT!r} "
        f"greedily:\n  {tokenizer.decode(got[0])!r}"
    )
    return CheckReport(exercise, True, n_cases)


def check_generate(fn) -> CheckReport:
    """fn(model, idx (B, T), max_new_tokens) -> (B, T + max_new_tokens): greedy tokens, the
    whole sequence run through the model at each step. Checked on lib's tiny Llama, then on the
    notebook's MyDecoder holding SmolLM2-135M-Instruct's weights."""
    exercise = "Step 3.7 (SmolLM2 in your decoder, greedy generation)"
    g = torch.Generator().manual_seed(140)
    cases = []
    for name, seed, idx, n in [
        ("lib's tiny Llama, B = 2, a 5-token prompt, 8 new tokens", 150, torch.randint(64, (2, 5), generator=g), 8),
        ("lib's tiny Llama, a 1-token prompt, 6 new tokens", 151, torch.randint(64, (1, 1), generator=g), 6),
    ]:
        model = tiny_llama(TINY, seed, std=0.5)
        expected = generate(model, idx, n, temperature=0.0, use_cache=False)
        cases.append(
            Case(name, (model, idx.clone(), n), expected, exact=True, diagnose=_diagnose_loop(model, idx, n, expected))
        )

    def learner(model, idx, n):
        with torch.no_grad():
            return fn(model, idx, n)

    n_cases = len(cases) + 2  # then SmolLM2's logits in the learner's decoder, and its tokens
    report = run_checks(exercise, learner, cases)
    if not report.passed:
        return dataclasses.replace(report, n_cases=n_cases)
    return _smollm2_in(exercise, fn, learner, n_cases)
