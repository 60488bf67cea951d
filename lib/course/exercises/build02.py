"""Checks for build track 02, "a BERT layer" (lessons/build/02-build-bert-layer.md).

    check_split_heads(fn)      fn(x (B, T, C), H) -> (B, H, T, D): head h holds the channels
                               h·D .. h·D + D - 1 of every token
    check_self_attention(cls)  cls(C, H) with Linear layers `query`, `key`, `value`;
                               module(x, mask) -> (B, T, C): multi-head softmax(QKᵀ/√D + M)V with
                               the heads merged, equal to lib.bert's BertSelfAttention loaded with
                               all-MiniLM-L6-v2's weights
    check_post_ln(fn)          fn(x, sublayer, norm) -> norm(x + sublayer(x)): BERT's residual
    check_feed_forward(fn)     fn(x, dense_in, dense_out, norm)
                               -> norm(x + dense_out(GELU(dense_in(x)))), the exact (erf) GELU
    check_bert_layer(cls)      cls(hidden_size, num_heads, intermediate_size, eps) with Hugging
                               Face's parameter names; module(x, mask) -> (B, T, C), equal to each
                               of all-MiniLM-L6-v2's six layers in transformers' BertModel on a
                               padded batch of real sentences, and, six stacked, to its output

Each check runs small made-up cases first and loads the real model only for an answer that
passes them, so that an unsolved notebook answers at once.

Glossary: B batch, T tokens, C hidden size, H heads, D = C / H head dim, F feed-forward width.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib.attention import safe_softmax
from lib.course.exercises import Case, CheckReport, call_learner, run_checks
from lib.course.exercises.build01 import SENTENCES, near, quiet_transformers, unless_earlier_unfinished, with_earlier
from lib.masks import padding_mask

__all__ = ["check_bert_layer", "check_feed_forward", "check_post_ln", "check_self_attention", "check_split_heads"]

# fp32. MiniLM's hidden states reach ~10, where one unit in the last place is ~1e-6; a layer's
# matmuls (384 and 1536 terms), softmax and two LayerNorms summed in another order differ by a
# few of those (measured: at most 4e-6 between lib.bert and transformers, per layer). 2e-5 +
# 1e-6·|x| leaves five times that, and still fails LayerNorm's default eps of 1e-5 in place of
# MiniLM's 1e-12 (7e-5 after one layer) and the tanh GELU (2e-3).
_TOL = dict(atol=2e-5, rtol=1e-6)
_MINILM_SIZES = (384, 12, 1536, 1e-12)  # hidden_size, num_heads, intermediate_size, eps


# --------------------------------------------------------------------------- the real model
@lru_cache(maxsize=1)
def _minilm() -> dict:
    """lib.bert's all-MiniLM-L6-v2 (equal to transformers' BertModel: tests/lib/test_bert.py), a
    padded batch of SENTENCES, its padding mask and the embeddings' output (layer 0's input)."""
    from lib.bert import load_minilm

    bert, tok = load_minilm()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        x = bert.embeddings(enc["input_ids"], enc["token_type_ids"])  # (B, T, C)
    return dict(bert=bert, enc=enc, mask=padding_mask(enc["attention_mask"]), x=x)


@lru_cache(maxsize=1)
def _minilm_transformers() -> dict:
    """transformers' own BertModel with all-MiniLM-L6-v2 on the same batch: each layer's weights
    (Hugging Face's names) and hidden states (hidden[i] enters layer i, hidden[i + 1] leaves it)."""
    from transformers import AutoModel

    from lib.bert import minilm_path

    with quiet_transformers():
        hf = AutoModel.from_pretrained(str(minilm_path()), attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = hf(**_minilm()["enc"], output_hidden_states=True).hidden_states
    layers = {i: {k: v.clone() for k, v in layer.state_dict().items()} for i, layer in enumerate(hf.encoder.layer)}
    return dict(hidden=hidden, layers=layers)


def _random_layer_weights(C: int, Fw: int, seed: int) -> dict[str, torch.Tensor]:
    """A BERT layer's state dict (Hugging Face's names), random weights of size ~1/√fan_in and
    LayerNorms that are not the identity, so that a forgotten weight or bias shows."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "attention.self.query": (C, C),
        "attention.self.key": (C, C),
        "attention.self.value": (C, C),
        "attention.output.dense": (C, C),
        "intermediate.dense": (Fw, C),
        "output.dense": (C, Fw),
    }
    state = {}
    for name, (n_out, n_in) in shapes.items():
        state[f"{name}.weight"] = torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in)
        state[f"{name}.bias"] = 0.1 * torch.randn(n_out, generator=g)
    for name in ("attention.output.LayerNorm", "output.LayerNorm"):
        state[f"{name}.weight"] = 1 + 0.2 * torch.randn(C, generator=g)
        state[f"{name}.bias"] = 0.1 * torch.randn(C, generator=g)
    return state


def _attention_part(state: dict) -> dict[str, torch.Tensor]:
    """A layer's state dict -> its self-attention's: attention.self.query.weight -> query.weight."""
    prefix = "attention.self."
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


# ------------------------------------------------------------------------ a layer, and its mistakes
def _split(t: torch.Tensor, H: int, how: str = "right") -> torch.Tensor:
    B, T, C = t.shape
    D = C // H
    if how == "view":  # the memory cut into H blocks: each head gets whole tokens, not channels
        return t.reshape(B, H, T, D)
    if how == "interleaved":  # head h gets the channels h, h + H, h + 2H, ...
        return t.view(B, T, D, H).permute(0, 3, 1, 2)
    return t.view(B, T, H, D).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)


def _merge(y: torch.Tensor, how: str = "right") -> torch.Tensor:
    B, H, T, D = y.shape
    if how == "no transpose":  # also the exact inverse of the "view" split
        return y.reshape(B, T, H * D)
    if how == "interleaved":
        return y.permute(0, 2, 3, 1).reshape(B, T, H * D)
    return y.transpose(1, 2).reshape(B, T, H * D)  # (B, H, T, D) -> (B, T, C)


def self_attention(
    x,
    mask,
    w: dict,
    H: int,
    prefix: str = "",
    *,
    split: str = "right",
    merge: str = "right",
    scale: bool = True,
    mask_on: str | None = "keys",
    softmax_dim: int = -1,
) -> torch.Tensor:
    """BERT's self-attention from a state dict `w` (`{prefix}query.weight`, ...): (B, T, C) ->
    (B, T, C), heads merged, before the output projection. The keyword arguments make the usual
    mistakes, for the diagnoses."""
    D = x.shape[-1] // H

    def heads(name):
        return _split(F.linear(x, w[f"{prefix}{name}.weight"], w[f"{prefix}{name}.bias"]), H, split)

    q, k, v = heads("query"), heads("key"), heads("value")  # (B, H, T, D) each
    scores = q @ k.transpose(-2, -1) / (math.sqrt(D) if scale else 1.0)  # (B, H, T, T)
    if mask_on == "keys":
        scores = scores + mask  # (B, 1, 1, T): the columns of the padding keys
    elif mask_on == "queries":
        scores = scores + mask.transpose(-2, -1)  # (B, 1, T, 1): the rows of the padding queries
    return _merge(safe_softmax(scores, dim=softmax_dim) @ v, merge)


def bert_layer(
    x,
    mask,
    w: dict,
    H: int,
    eps: float,
    *,
    norm: str = "post",
    gelu: str = "erf",
    attention_residual: bool = True,
    ffn_residual: bool = True,
    **attention,
) -> torch.Tensor:
    """One BERT layer from a state dict with Hugging Face's names: Post-LN, the exact GELU. The
    keyword arguments make the usual mistakes (norm="pre", gelu="tanh", a residual left out...)."""
    C = x.shape[-1]

    def ln(t, name):
        return F.layer_norm(t, (C,), w[f"{name}.weight"], w[f"{name}.bias"], eps)

    def lin(t, name):
        return F.linear(t, w[f"{name}.weight"], w[f"{name}.bias"])

    def attend(t):
        y = self_attention(t, mask, w, H, "attention.self.", **attention)
        return lin(y, "attention.output.dense")

    def ffn(t):
        h = lin(t, "intermediate.dense")
        act = {"tanh": lambda z: F.gelu(z, approximate="tanh"), "relu": F.relu}.get(gelu, F.gelu)
        return lin(act(h), "output.dense")

    if norm == "pre":
        x = x + attend(ln(x, "attention.output.LayerNorm"))
        return x + ffn(ln(x, "output.LayerNorm"))
    x = ln(x + attend(x) if attention_residual else attend(x), "attention.output.LayerNorm")
    return ln(x + ffn(x) if ffn_residual else ffn(x), "output.LayerNorm")


_SPLIT_CHANNELS = "split the channels: view(B, T, H, D).transpose(1, 2)"
_ATTENTION_MISTAKES = [
    (
        dict(split="view"),
        "the heads were split with view(B, H, T, D): that cuts the memory into "
        f"H blocks of whole tokens; {_SPLIT_CHANNELS}",
    ),
    (
        dict(split="view", merge="no transpose"),
        "the heads were split with view(B, H, T, D) (and merged back by its inverse): that cuts the "
        f"memory into H blocks of whole tokens; {_SPLIT_CHANNELS}",
    ),
    (
        dict(merge="no transpose"),
        "the heads were merged without transposing back: (B, H, T, D) "
        "-> transpose(1, 2) -> (B, T, H, D) -> reshape(B, T, C)",
    ),
    (
        dict(split="interleaved", merge="interleaved"),
        "the channels were dealt to the heads in turn: head h owns the D channels h·D .. h·D + D - 1, "
        "so view(B, T, H, D), not (B, T, D, H)",
    ),
    (dict(scale=False), "the scores were not scaled: divide QKᵀ by √D, D = C / H (32 for MiniLM)"),
    (dict(mask_on=None), "the padding mask was not applied: add it to the scores before the softmax"),
    (
        dict(mask_on="queries"),
        "the padding mask blocked queries (rows) instead of keys: add the "
        "(B, 1, 1, T) mask as it is, so that it blocks the padding keys' "
        "columns",
    ),
    (dict(softmax_dim=-2), "the softmax ran over the queries: normalise over the keys, dim=-1"),
]


def _nan_hint(case) -> str:
    return (
        "NaN: did a whole row of scores get -inf? Add the (B, 1, 1, T) mask to the "
        "(B, H, T, T) scores as it is: it blocks the padding keys (columns), and every query "
        "row keeps its real keys"
    )


# --------------------------------------------------------------------------- the learner's module
def _modules(names: list[str]) -> str:
    """Parameter names as the modules that hold them: "query.weight", "query.bias" -> "query"."""
    modules = list(dict.fromkeys(k.rsplit(".", 1)[0] for k in names))
    return ", ".join(modules[:12]) + (", ..." if len(modules) > 12 else "")


def _parameter_report(name: str, n: int, case: str, module, state: dict) -> CheckReport | None:
    """Load `state` into the learner's module when it holds exactly those parameters (names and
    shapes): None then, else a report that names what was expected."""
    if not isinstance(module, nn.Module):
        return CheckReport(
            name,
            False,
            n,
            case,
            f"the class built a {type(module).__name__}, not an nn.Module",
            "subclass torch.nn.Module and call super().__init__()",
        )
    theirs = module.state_dict()
    missing = sorted(set(state) - set(theirs))
    unexpected = sorted(set(theirs) - set(state))
    if missing or unexpected:
        parts = ([f"missing {_modules(missing)}"] if missing else []) + (
            [f"unexpected {_modules(unexpected)}"] if unexpected else []
        )
        return CheckReport(
            name,
            False,
            n,
            case,
            "its parameter names are not the checkpoint's: " + "; ".join(parts),
            "name the layers as Hugging Face's BERT does, so that the state dict "
            "loads by name; expected exactly these, each with a .weight and a "
            f".bias: {_modules(list(state))}",
        )
    wrong = [
        f"{k} {tuple(theirs[k].shape)} (expected {tuple(v.shape)})"
        for k, v in state.items()
        if theirs[k].shape != v.shape
    ]
    if wrong:
        return CheckReport(
            name,
            False,
            n,
            case,
            "parameters of the wrong shape: " + ", ".join(wrong[:3]),
            "nn.Linear(n_in, n_out) stores its weight as (n_out, n_in)",
        )
    module.load_state_dict(state)
    module.eval()
    return None


def _built(name: str, cls, args: tuple, state: dict, case: str, n: int):
    """(the learner's module built from `args` and loaded with `state`, None), or (None, a report
    when the constructor raised, is a stub, or the names or shapes do not fit)."""
    module, report = call_learner(name, cls, args, case, n)
    if report is None:
        report = _parameter_report(name, n, case, module, state)
    return (None, report) if report is not None else (module, None)


def _no_grad(fn):
    """fn without autograd (a non-callable goes on to call_learner, which explains it)."""
    if not callable(fn):
        return fn

    def call(*args):
        with torch.no_grad():
            return fn(*args)

    return call


def _staged(name: str, stages) -> CheckReport:
    """run_checks over stages of cases, each built only once those before it passed (the real
    model loads only for an answer that passes the small cases); one report for all of them.
    A stage returns (cases, the function to call, nan_hint, a report if it could not start)."""
    total = 0
    for stage in stages:
        cases, call, nan_hint, report = stage()
        if report is None:
            report = run_checks(name, call, cases, nan_hint=nan_hint)
        total += len(cases)
        if not report.passed:
            return report
    return CheckReport(name, True, total)


# --------------------------------------------------------------------------- 2.1 split heads
def _diagnose_split(x: torch.Tensor, H: int):
    B, T, C = x.shape
    D = C // H

    def diagnose(got: torch.Tensor) -> str | None:
        if got.shape == (B, T, H, D) and T != H:
            return "that is (B, T, H, D): now swap T and H with .transpose(1, 2)"
        if got.shape == (B, H, D, T) and D != T:
            return "that is (B, H, D, T): the last two dimensions must be (T, D)"
        if got.shape != (B, H, T, D):
            return f"the result is (B, H, T, D) = {(B, H, T, D)}, with D = C // H"
        if torch.equal(got, _split(x, H, "view")):
            return (
                "view(B, H, T, D) cuts the memory into H blocks of whole tokens: each head "
                "must get D channels of every token; view(B, T, H, D), then .transpose(1, 2)"
            )
        if torch.equal(got, _split(x, H, "interleaved")):
            return (
                "the channels were dealt to the heads in turn: head h owns the D consecutive "
                "channels h·D .. h·D + D - 1, so view(B, T, H, D), not (B, T, D, H)"
            )
        if T == H and torch.equal(got, x.view(B, T, H, D)):
            return "that is still (B, T, H, D), only T = H here hides it: .transpose(1, 2)"
        return None

    return diagnose


def check_split_heads(fn) -> CheckReport:
    """fn(x (B, T, C), H) must return (B, H, T, D), D = C / H, with
    out[b, h, t] = x[b, t, h·D:(h+1)·D]."""
    g = torch.Generator().manual_seed(21)
    cases = []
    for name, (B, T, C, H) in [
        ("B = 2, T = 5, C = 12, H = 3", (2, 5, 12, 3)),
        ("T = H = 4 (a missing transpose keeps the shape), C = 8", (1, 4, 8, 4)),
        ("T = 1, C = 6, H = 2", (2, 1, 6, 2)),
        ("MiniLM's sizes: C = 384, H = 12, T = 7", (1, 7, 384, 12)),
    ]:
        x = torch.randn(B, T, C, generator=g)
        cases.append(Case(name, (x, H), _split(x, H), exact=True, diagnose=_diagnose_split(x, H)))
    report = run_checks("Step 2.1 (split into heads)", fn, cases)
    if "view size is not compatible" in (report.problem or ""):
        report.hint = (
            "view needs memory laid out as the new shape reads it: view(B, T, H, D) "
            "first, then transpose (a transposed tensor needs reshape)"
        )
    return report


# --------------------------------------------------------------------------- 2.2 self-attention
def check_self_attention(cls) -> CheckReport:
    """cls(C, H) must build Linear layers `query`, `key`, `value` (C -> C); module(x (B, T, C),
    mask (B, 1, 1, T)) must return (B, T, C): each head's softmax(QKᵀ/√D + M)V, the heads merged
    back, as lib.bert's BertSelfAttention (without the output projection, which BERT keeps in
    attention.output)."""
    name = "Step 2.2 (self-attention with the padding mask)"
    steps = [("my_split_heads", check_split_heads, "Step 2.1")]
    n = 4

    def case(case_name, w, H, x, mask, want):
        def diagnose(got):
            if got.shape == (x.shape[0], H, x.shape[1], x.shape[2] // H):
                return "merge the heads back: (B, H, T, D) -> transpose(1, 2) -> reshape(B, T, C)"
            hint = next((h for kw, h in _ATTENTION_MISTAKES if near(got, self_attention(x, mask, w, H, **kw))), None)
            return with_earlier(hint, cls, steps)

        return Case(case_name, (x, mask), want, **_TOL, diagnose=diagnose)

    def small():
        C, H = 12, 3
        w = _attention_part(_random_layer_weights(C, 4 * C, 22))
        module, report = _built(name, cls, (C, H), w, "C = 12, H = 3 (random weights)", n)
        if report is not None:
            return [], None, None, report
        x = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(22))
        mask = padding_mask(torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
        cases = [
            case("random weights, C = 12, H = 3, padding on both sides", w, H, x, mask, self_attention(x, mask, w, H))
        ]
        return cases, _no_grad(module), _nan_hint, None

    def real():
        data = _minilm()
        lib_attention = data["bert"].encoder.layer[0].attention.self
        w = {k: v.detach() for k, v in lib_attention.state_dict().items()}
        C, H = _MINILM_SIZES[:2]
        module, report = _built(name, cls, (C, H), w, "all-MiniLM-L6-v2's sizes, C = 384, H = 12", n)
        if report is not None:
            return [], None, None, report
        x, keep = data["x"], data["enc"]["attention_mask"]
        first = int(keep[0].sum())
        cases = []
        for case_name, xs, ks in [
            ("all-MiniLM-L6-v2's layer 0 on one sentence, no padding", x[:1, :first], keep[:1, :first]),
            ("all-MiniLM-L6-v2's layer 0 on a padded batch of 3 sentences", x, keep),
            ("all-MiniLM-L6-v2's layer 0 on one token (T = 1)", x[2:3, :1], keep[2:3, :1]),
        ]:
            mask = padding_mask(ks)
            with torch.no_grad():
                want = lib_attention(xs, mask)[0]  # lib.bert's BertSelfAttention, (B, T, C)
            cases.append(case(case_name, w, H, xs, mask, want))
        return cases, _no_grad(module), _nan_hint, None

    return unless_earlier_unfinished(_staged(name, (small, real)), cls, steps)


# --------------------------------------------------------------------------- 2.3 Post-LN residual
def _diagnose_post_ln(x, sublayer, norm):
    with torch.no_grad():
        s = sublayer(x)
        variants = [
            (
                x + sublayer(norm(x)),
                "that is Pre-LN, x + sublayer(LayerNorm(x)) (GPT-2's order): "
                "BERT normalises after the sum, LayerNorm(x + sublayer(x))",
            ),
            (norm(s), "the residual is missing: add x to the sublayer's output, then normalise"),
            (x + norm(s), "only the sublayer's output was normalised: normalise the sum, LayerNorm(x + sublayer(x))"),
            (norm(x) + s, "normalise the sum x + sublayer(x), not x alone"),
            (norm(x + s) + x, "x was added twice: LayerNorm(x + sublayer(x)) is all"),
            (
                F.layer_norm(x + s, x.shape[-1:]),
                "use the norm you are given: it holds a learned weight and bias (and its eps), which "
                "F.layer_norm without them leaves out",
            ),
        ]

    def diagnose(got):
        return next((h for want, h in variants if near(got, want)), None)

    return diagnose


def check_post_ln(fn) -> CheckReport:
    """fn(x (B, T, C), sublayer, norm) must return norm(x + sublayer(x)): the sublayer's output
    added to its input, then normalised (BERT's Post-LN; dropout is off in a trained model)."""
    name = "Step 2.3 (the Post-LN residual)"

    def small():
        g = torch.Generator().manual_seed(23)
        C = 6
        torch.manual_seed(23)
        sublayer, norm = nn.Linear(C, C), nn.LayerNorm(C, eps=1e-12)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.5 * torch.randn(C, generator=g))
            norm.bias.copy_(torch.randn(C, generator=g))
            x = 2 * torch.randn(2, 3, C, generator=g) + 1
            want = norm(x + sublayer(x))
        return (
            [
                Case(
                    "a small Linear sublayer, C = 6, a LayerNorm with its own weight and bias",
                    (x, sublayer, norm),
                    want,
                    **_TOL,
                    diagnose=_diagnose_post_ln(x, sublayer, norm),
                )
            ],
            _no_grad(fn),
            None,
            None,
        )

    def real():
        data = _minilm()
        att, mask, x = data["bert"].encoder.layer[0].attention, data["mask"], data["x"]

        def attention_sublayer(h):  # the self-attention and its output projection
            return att.output.dense(att.self(h, mask)[0])

        norm = att.output.LayerNorm
        with torch.no_grad():
            want = norm(x + attention_sublayer(x))
        return (
            [
                Case(
                    "all-MiniLM-L6-v2's layer 0: its self-attention (+ output projection) as "
                    "the sublayer, its attention.output.LayerNorm, on a padded batch",
                    (x, attention_sublayer, norm),
                    want,
                    **_TOL,
                    diagnose=_diagnose_post_ln(x, attention_sublayer, norm),
                )
            ],
            _no_grad(fn),
            None,
            None,
        )

    return _staged(name, (small, real))


# --------------------------------------------------------------------------- 2.4 feed-forward
_FFN_STEPS = [("my_post_ln", check_post_ln, "Step 2.3")]


def _diagnose_ffn(x, dense_in, dense_out, norm, fn):
    with torch.no_grad():
        h = dense_in(x)
        variants = [
            (
                norm(x + dense_out(F.gelu(h, approximate="tanh"))),
                'that is the tanh approximation of GELU: BERT\'s "gelu" is the exact one, x·Φ(x) '
                "with erf (F.gelu(h), approximate='none')",
            ),
            (norm(x + dense_out(F.relu(h))), "that is ReLU: BERT uses GELU, F.gelu(h)"),
            (norm(dense_out(F.gelu(h))), "the residual is missing: LayerNorm(x + FFN(x))"),
            (
                x + dense_out(F.gelu(dense_in(norm(x)))),
                "that is Pre-LN, x + FFN(LayerNorm(x)): BERT normalises after the sum, LayerNorm(x + FFN(x))",
            ),
            (x + dense_out(F.gelu(h)), "the LayerNorm is missing: LayerNorm(x + FFN(x))"),
            (
                norm(x + F.gelu(dense_out(F.gelu(h)))),
                "GELU comes once, between the two Linear layers, not after the second",
            ),
            (norm(x + dense_out(h)), "the activation is missing: GELU between the two Linear layers"),
        ]

    def diagnose(got):
        hint = next((h for want, h in variants if near(got, want)), None)
        return with_earlier(hint, fn, _FFN_STEPS)

    return diagnose


def check_feed_forward(fn) -> CheckReport:
    """fn(x (B, T, C), dense_in (C -> F), dense_out (F -> C), norm) must return
    norm(x + dense_out(GELU(dense_in(x)))) with the exact (erf) GELU: BERT's feed-forward."""
    name = "Step 2.4 (the feed-forward sublayer)"

    def small():
        g = torch.Generator().manual_seed(24)
        C, Fw = 6, 24
        torch.manual_seed(24)
        dense_in, dense_out, norm = nn.Linear(C, Fw), nn.Linear(Fw, C), nn.LayerNorm(C, eps=1e-12)
        with torch.no_grad():
            dense_in.weight.mul_(4.0)  # pre-activations over [-4, 4], where the GELUs differ most
            norm.weight.copy_(1 + 0.5 * torch.randn(C, generator=g))
            norm.bias.copy_(torch.randn(C, generator=g))
            x = torch.randn(2, 3, C, generator=g)
            want = norm(x + dense_out(F.gelu(dense_in(x))))
        args = (x, dense_in, dense_out, norm)
        return (
            [
                Case(
                    "small Linear layers, C = 6, F = 24, a LayerNorm with its own weight and bias",
                    args,
                    want,
                    **_TOL,
                    diagnose=_diagnose_ffn(*args, fn),
                )
            ],
            _no_grad(fn),
            None,
            None,
        )

    def real():
        data = _minilm()
        layer = data["bert"].encoder.layer[0]
        att = layer.attention
        with torch.no_grad():  # the feed-forward's real input: layer 0 after its attention part
            x = att.output.LayerNorm(data["x"] + att.output.dense(att.self(data["x"], data["mask"])[0]))
            args = (x, layer.intermediate.dense, layer.output.dense, layer.output.LayerNorm)
            want = layer.output.LayerNorm(x + layer.output.dense(layer.intermediate(x)))
        return (
            [
                Case(
                    "all-MiniLM-L6-v2's layer 0: its intermediate.dense, output.dense and "
                    "output.LayerNorm, on the padded batch after the attention sublayer",
                    args,
                    want,
                    **_TOL,
                    diagnose=_diagnose_ffn(*args, fn),
                )
            ],
            _no_grad(fn),
            None,
            None,
        )

    return unless_earlier_unfinished(_staged(name, (small, real)), fn, _FFN_STEPS)


# --------------------------------------------------------------------------- 2.5 the whole layer
_LAYER_MISTAKES = [
    (
        dict(norm="pre"),
        "that is Pre-LN (x + sublayer(LayerNorm(x))): BERT normalises after each "
        "residual sum, LayerNorm(x + sublayer(x))",
    ),
    (dict(gelu="tanh"), "the feed-forward uses the tanh GELU: BERT's is the exact (erf) one, F.gelu(h)"),
    (dict(gelu="relu"), "the feed-forward uses ReLU: BERT's activation is GELU (exact, erf)"),
    (
        dict(attention_residual=False),
        "the attention sublayer's residual is missing: LayerNorm(x + dense(self_attention(x)))",
    ),
    (dict(ffn_residual=False), "the feed-forward's residual is missing: LayerNorm(x + FFN(x))"),
] + _ATTENTION_MISTAKES


_LAYER_STEPS = [
    ("MySelfAttention", check_self_attention, "Step 2.2"),
    ("my_post_ln", check_post_ln, "Step 2.3"),
    ("my_feed_forward", check_feed_forward, "Step 2.4"),
    ("my_split_heads", check_split_heads, "Step 2.1"),
]


def _diagnose_layer(x, mask, w, H, eps, cls):
    def diagnose(got):
        with torch.no_grad():
            hint = next((h for kw, h in _LAYER_MISTAKES if near(got, bert_layer(x, mask, w, H, eps, **kw))), None)
            if hint is None and eps < 1e-6 and near(got, bert_layer(x, mask, w, H, 1e-5), dict(atol=2e-5, rtol=1e-5)):
                hint = (
                    "the LayerNorms use eps = 1e-5 (nn.LayerNorm's default): pass the "
                    f"constructor's eps ({eps:g} for MiniLM), nn.LayerNorm(C, eps=eps)"
                )
        return with_earlier(hint, cls, _LAYER_STEPS)

    return diagnose


def _lib_layer(state: dict, C: int, H: int, Fw: int, eps: float):
    """lib.bert's BertLayer with these weights, as a function (x, mask) -> (B, T, C)."""
    from lib.bert import BertConfig, BertLayer

    config = BertConfig(
        hidden_size=C,
        num_attention_heads=H,
        intermediate_size=Fw,
        layer_norm_eps=eps,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    layer = BertLayer(config).eval()
    layer.load_state_dict(state)
    return _no_grad(lambda x, mask: layer(x, mask)[0])


def check_bert_layer(cls) -> CheckReport:
    """cls(hidden_size, num_heads, intermediate_size, eps) must hold Hugging Face's parameter
    names (attention.self.query, ..., output.LayerNorm); loaded with each of all-MiniLM-L6-v2's
    six layers, module(x (B, T, C), mask (B, 1, 1, T)) must give what that layer gives in
    transformers' BertModel on a padded batch of real sentences, and six stacked on the
    embeddings the model's last hidden state."""
    name = "Step 2.5 (a whole BERT layer, with MiniLM's weights)"
    n_cases = 8

    def small():
        C, H, Fw, eps = 12, 3, 48, 1e-12
        w = _random_layer_weights(C, Fw, 25)
        module, report = _built(name, cls, (C, H, Fw, eps), w, "C = 12, H = 3, F = 48 (random weights)", n_cases)
        if report is not None:
            return [], None, None, report
        x = 2 * torch.randn(2, 6, C, generator=torch.Generator().manual_seed(25))
        mask = padding_mask(torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]))
        return (
            [
                Case(
                    "random weights, C = 12, H = 3, F = 48, padding on both sides",
                    (x, mask),
                    _lib_layer(w, C, H, Fw, eps)(x, mask),
                    **_TOL,
                    diagnose=_diagnose_layer(x, mask, w, H, eps, cls),
                )
            ],
            _no_grad(module),
            _nan_hint,
            None,
        )

    def minilm_layer(i):
        def stage():
            hf, mask = _minilm_transformers(), _minilm()["mask"]
            state = hf["layers"][i]
            C, H, Fw, eps = _MINILM_SIZES
            case = f"all-MiniLM-L6-v2's layer {i} (of 6), its weights, on a padded batch of 3 sentences"
            module, report = _built(name, cls, (C, H, Fw, eps), state, case, n_cases)
            if report is not None:
                return [], None, None, report
            x = hf["hidden"][i]  # what enters layer i in transformers' BertModel
            return (
                [
                    Case(
                        f"{case}: against transformers' BertModel",
                        (x, mask),
                        hf["hidden"][i + 1],
                        **_TOL,
                        diagnose=_diagnose_layer(x, mask, state, H, eps, cls),
                    )
                ],
                _no_grad(module),
                _nan_hint,
                None,
            )

        return stage

    def stacked():
        hf, data = _minilm_transformers(), _minilm()
        real = data["enc"]["attention_mask"].bool()  # (B, T)

        def encoder(x, mask):  # six of the learner's layers, each with its own weights
            for state in hf["layers"].values():
                layer = cls(*_MINILM_SIZES)
                layer.load_state_dict(state)
                with torch.no_grad():
                    x = layer.eval()(x, mask)
            return x[real]  # (B, T, C) -> (real tokens, C)

        # At the real positions only: nothing reads a padding query's output, and its rounding
        # grows from layer to layer (to ~8e-5 for lib.bert too); the real ones stay within 5e-6.
        return (
            [
                Case(
                    "your six layers stacked on MiniLM's embeddings: its last hidden state at the real tokens",
                    (hf["hidden"][0], data["mask"]),
                    hf["hidden"][-1][real],
                    **_TOL,
                )
            ],
            encoder,
            _nan_hint,
            None,
        )

    report = _staged(name, [small] + [minilm_layer(i) for i in range(6)] + [stacked])
    report.n_cases = n_cases
    return unless_earlier_unfinished(report, cls, _LAYER_STEPS)
