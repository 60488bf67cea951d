"""Checks for build track 01, "attention from nothing" (lessons/build/01-build-attention.md).

    check_scores(fn)             fn(q (B, H, T, D), k (B, H, S, D)) -> (B, H, T, S), the scores
                                 QKᵀ/√D, equal to lib.attention.attention_scores
    check_document_mask(fn)      fn(doc_ids (B, T)) -> (B, 1, T, T) additive mask for packed
                                 documents: causal inside a document, nothing across documents
    check_safe_softmax(fn)       fn(scores) -> softmax over the last dimension, all-zero rows
                                 where every score is -inf: lib.attention.safe_softmax
    check_attention_weights(fn)  fn(q, k, mask) -> (B, H, T, S) weights, equal to
                                 lib.attention.attention_weights and to all-MiniLM-L6-v2's own
                                 attention probabilities (transformers' BertModel) on real text
    check_attention(fn)          fn(q, k, v, mask) -> (B, H, T, D), equal to
                                 lib.attention.attention_ref under every mask of lesson 01's zoo

A later step's check also says when the wrong answer comes from an earlier step's function that
it calls (`earlier_step_hint`), so that the student knows which cell to fix.

Glossary: B batch, H heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import math
import types
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable

import torch

from lib.attention import attention_ref, attention_scores, attention_weights, safe_softmax
from lib.course.exercises import Case, CheckReport, run_checks
from lib.masks import (
    additive_from_bool,
    causal_mask,
    combine_masks,
    cross_attention_mask,
    padding_mask,
    prefix_lm_mask,
    sliding_window_mask,
)

__all__ = ["check_attention", "check_attention_weights", "check_document_mask", "check_safe_softmax", "check_scores"]

NEG_INF = float("-inf")
# fp32 throughout. A score is a D-term dot product (D <= 32) of values of size ~1: another order
# of summation, or scaling q before the product instead of after, moves it by ~1e-6 relative, and
# a softmax and a weighted sum of at most 18 values keep that (measured on MiniLM's real q, k:
# 4e-7 against transformers). 1e-5 + 1e-4 relative accepts every correct order; the mistakes the
# checks name change the results by 1e-2 or more.
_TOL = dict(atol=1e-5, rtol=1e-4)
# a wrong answer "is" a named mistake when it matches that mistake's result this closely
_NEAR = dict(atol=1e-4, rtol=1e-4)
SENTENCES = [
    "The cat sat on the mat.",
    "An encoder reads the whole sentence at once, left and right together.",
    "Hello!",
]


# --------------------------------------------------------------------------- shared helpers
def near(got, want: torch.Tensor, tol: dict = _NEAR) -> bool:
    """Whether `got` is `want` up to `tol` (same shape; NaN and ±inf compared as 0)."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not got.is_floating_point():
        return False
    clean = lambda t: t.double().nan_to_num(0.0, posinf=0.0, neginf=0.0)  # noqa: E731
    return bool(torch.allclose(clean(got), clean(want), **tol))


def _code_names(code: types.CodeType) -> set[str]:
    """Every global name a code object (and the lambdas and comprehensions inside it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _functions(obj) -> list[types.FunctionType]:
    """The Python functions behind a learner's answer: the function, or a class's methods."""
    if isinstance(obj, types.FunctionType):
        return [obj]
    if isinstance(obj, type):
        return [
            f
            for klass in obj.__mro__
            if not klass.__module__.startswith("torch.")
            for f in vars(klass).values()
            if isinstance(f, types.FunctionType)
        ]
    return []


def earlier_step_hint(fn, steps: list[tuple[str, Callable, str]]) -> str | None:
    """For a later step: the first earlier step's function that `fn` uses and that fails its own
    check, as a hint naming the step to fix. `steps` holds (that function's or class's name in the
    learner's notebook, its check, "Step N.k")."""
    functions = _functions(fn)
    if not functions:
        return None
    used = set().union(*(_code_names(f.__code__) for f in functions))
    namespace = functions[0].__globals__
    for name, check, step in steps:
        if name in used and name in namespace and namespace[name] is not fn:
            report = check(namespace[name])
            if report.problem == "not attempted yet":
                return (
                    f"this comes from {step}: your {name} is not written yet (it raises "
                    "NotImplementedError); do that step first, then run this cell again"
                )
            if not report.passed:
                return (
                    f"this comes from {step}: your {name} does not pass its own check yet "
                    f"({report.problem}); fix it there and run both cells again"
                )
    return None


def unless_earlier_unfinished(report: CheckReport, fn, steps) -> CheckReport:
    """A "not attempted yet" report for a step whose own code is written but calls an earlier
    step's stub: the hint then names that step (the NotImplementedError came from there)."""
    if report.problem == "not attempted yet":
        report.hint = earlier_step_hint(fn, steps) or report.hint
    return report


def with_earlier(hint: str | None, fn, steps) -> str | None:
    """A diagnosed hint, followed by the earlier step to fix when one fails its check."""
    earlier = earlier_step_hint(fn, steps)
    if hint and earlier:
        return f"{hint} ({earlier})"
    return hint or earlier


def _on_copies(fn):
    """fn called on clones of its tensor arguments, so that an answer working in place cannot
    change the inputs the diagnosis compares with (a non-callable goes on to call_learner)."""
    if not callable(fn):
        return fn

    def call(*args):
        return fn(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))

    return call


def _explain_error(report: CheckReport, hint: str) -> CheckReport:
    """Give a report of the learner's code raising a shape error a hint on what the shapes should
    be (call_learner's own hint only says to try the case by hand)."""
    problem = report.problem or ""
    if (
        not report.passed
        and problem.startswith("your function raised")
        and any(words in problem for words in ("size", "shape", "dimension", "broadcast"))
    ):
        report.hint = hint
    return report


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


@contextmanager
def quiet_transformers():
    """No progress bar while transformers loads a model (it would print timings)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@lru_cache(maxsize=1)
def _minilm_attention() -> dict:
    """all-MiniLM-L6-v2 in transformers (eager attention) on a padded batch of SENTENCES: for its
    first and last layer the real q, k, v (B, H, T, D) from the layer's own projections of its
    input, and its attention probabilities (B, H, T, T); the batch's padding mask (B, 1, 1, T)."""
    from transformers import AutoModel

    from lib.bert import minilm_path, minilm_tokenizer

    with quiet_transformers():
        hf = AutoModel.from_pretrained(str(minilm_path()), attn_implementation="eager").eval()
    enc = minilm_tokenizer()(SENTENCES, padding=True, return_tensors="pt")
    H = hf.config.num_attention_heads
    layers = {}
    with torch.no_grad():
        out = hf(**enc, output_hidden_states=True, output_attentions=True)
        for i in (0, len(out.attentions) - 1):
            x = out.hidden_states[i]  # (B, T, C): the layer's input
            B, T, C = x.shape
            att = hf.encoder.layer[i].attention.self
            q, k, v = (
                proj(x).view(B, T, H, C // H).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)
                for proj in (att.query, att.key, att.value)
            )
            layers[i] = dict(q=q, k=k, v=v, probs=out.attentions[i])
    keep = enc["attention_mask"]
    return dict(layers=layers, mask=padding_mask(keep), keep=keep)


# --------------------------------------------------------------------------- 1.1 scores
def _diagnose_scores(q: torch.Tensor, k: torch.Tensor):
    B, H, T, D = q.shape
    S = k.shape[2]
    raw = q @ k.transpose(-2, -1)  # (B, H, T, S)
    head_dim = "the scale is √D, the head dim q.shape[-1]"
    variants = [
        (raw, "the scores were not scaled: divide QKᵀ by √D (D = q.shape[-1], the head dim)"),
        (raw / D, "that divides by D: the scale is 1/√D, math.sqrt(D)"),
        (raw * math.sqrt(D), "that multiplies by √D: divide by it"),
        (
            torch.softmax(raw / math.sqrt(D), -1),
            "that is already a softmax: this step stops at the scaled scores, before the mask and the softmax",
        ),
    ]
    if T not in (1, D):
        variants.append((raw / math.sqrt(T), f"that divides by √T, the number of queries: {head_dim}"))
    if S not in (1, D, T):
        variants.append((raw / math.sqrt(S), f"that divides by √S, the number of keys: {head_dim}"))
    if S == T:
        variants.append(
            (
                (k @ q.transpose(-2, -1)) / math.sqrt(D),
                "rows and columns swapped: row i is query i, column j key j, so compute "
                "q @ k.transpose(-2, -1), not k @ q.transpose(-2, -1)",
            )
        )

    def diagnose(got: torch.Tensor) -> str | None:
        if got.shape == (B, H, S, T) and S != T:
            return (
                "that is (B, H, S, T): rows must be the queries, q @ k.transpose(-2, -1) gives "
                "(B, H, T, D) @ (B, H, D, S) -> (B, H, T, S)"
            )
        if got.shape == (B, H, D, D):
            return (
                "that multiplied over the positions: the dot product runs over D, "
                "q @ k.transpose(-2, -1), not q.transpose(-2, -1) @ k"
            )
        return next((hint for want, hint in variants if near(got, want)), None)

    return diagnose


def check_scores(fn) -> CheckReport:
    """fn(q (B, H, T, D), k (B, H, S, D)) must return the (B, H, T, S) scores QKᵀ/√D."""
    g = torch.Generator().manual_seed(11)
    cases = []
    for name, (B, H, T, S, D) in [
        ("B = 2, H = 3, T = 5 queries, S = 7 keys, D = 8", (2, 3, 5, 7, 8)),
        ("one query, one key: B = H = T = S = 1, D = 4", (1, 1, 1, 1, 4)),
        ("T = S = 6, D = 16", (1, 2, 6, 6, 16)),
        ("MiniLM's head size: T = 3, S = 9, D = 32", (2, 2, 3, 9, 32)),
    ]:
        q, k = _randn(g, B, H, T, D), _randn(g, B, H, S, D)
        cases.append(Case(name, (q, k), attention_scores(q, k), **_TOL, diagnose=_diagnose_scores(q, k)))
    report = run_checks("Step 1.1 (the scores QKᵀ/√D)", _on_copies(fn), cases)
    return _explain_error(
        report,
        "the dot product runs over D: q @ k.transpose(-2, -1) "
        "multiplies (B, H, T, D) by (B, H, D, S), giving (B, H, T, S)",
    )


# --------------------------------------------------------------------------- 1.2 document mask
def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) additive mask: query i sees key j when both lie in one
    document and j <= i (packed causal training: documents side by side in one row)."""
    T = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T): i and j in one document
    return combine_masks(additive_from_bool(same)[:, None], causal_mask(T))  # (B, 1, T, T)


def _diagnose_document(doc_ids: torch.Tensor):
    B, T = doc_ids.shape
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    past = torch.ones(T, T, dtype=torch.bool).tril()  # key j <= query i
    blocked = ~(same & past)[:, None]  # (B, 1, T, T)

    def diagnose(got: torch.Tensor) -> str | None:
        if got.dtype == torch.bool:
            return "return an additive float mask (0 = may look, -inf = may not), not True/False"
        if not got.is_floating_point():
            return "the mask must be a floating tensor so that it can hold -inf"
        if got.shape == (B, T, T):
            return "add the head dimension: (B, T, T) -> (B, 1, T, T), e.g. with [:, None]"
        if got.shape == (T, T):
            return "each row of the batch packs its own documents: keep the batch dimension"
        if got.shape != (B, 1, T, T):
            return None
        finite = got[torch.isfinite(got)]
        if finite.numel() and bool((finite != 0).any()):
            return "allowed entries must be exactly 0 and blocked ones exactly -inf (float('-inf'), not -1e9)"
        got_blocked = torch.isneginf(got)
        if torch.equal(got_blocked, ~blocked):
            return "inverted: 0 where a query may look, -inf where it may not"
        if torch.equal(got_blocked, ~same[:, None]):
            return (
                "a token sees the later tokens of its own document: inside a document the "
                "mask is causal, key j <= query i"
            )
        if torch.equal(got_blocked, ~past.expand(B, 1, T, T)):
            return (
                "a token sees the earlier documents of its row: block every key whose "
                "document id differs from the query's"
            )
        if torch.equal(got_blocked, ~(same | past)[:, None]):
            return "combine the two conditions with AND: same document AND key j <= query i (you used OR)"
        if torch.equal(got_blocked, blocked | torch.eye(T, dtype=torch.bool)):
            return "the diagonal is -inf: every token must see itself (j <= i, not j < i)"
        return None

    return diagnose


def check_document_mask(fn) -> CheckReport:
    """fn(doc_ids (B, T) int64) must return the (B, 1, T, T) float32 additive mask that is causal
    inside each document and blocks every key of another document."""
    cases = []
    for name, ids in [
        ("three documents packed into 8 tokens", [[0, 0, 0, 1, 1, 2, 2, 2]]),
        ("one document of 5 tokens (plain causal)", [[0, 0, 0, 0, 0]]),
        (
            "B = 2, ids that are not 0, 1, 2: [7, 7, 3, 3, 3, 9] and one-token documents",
            [[7, 7, 3, 3, 3, 9], [4, 5, 6, 6, 8, 8]],
        ),
        ("T = 1", [[3]]),
    ]:
        doc_ids = torch.tensor(ids)
        cases.append(Case(name, (doc_ids,), document_mask(doc_ids), exact=True, diagnose=_diagnose_document(doc_ids)))
    return run_checks("Step 1.2 (a mask for packed documents)", _on_copies(fn), cases)


# --------------------------------------------------------------------------- 1.3 safe softmax
def _diagnose_softmax(scores: torch.Tensor):
    full = torch.isneginf(scores).all(dim=-1)  # rows with no visible key
    variants = []
    if scores.dim() >= 2 and scores.shape[-2] > 1:
        variants.append(
            (safe_softmax(scores, dim=-2), "that normalised down the columns: the softmax runs over the keys, dim=-1")
        )
    if scores.dim() > 2:
        variants.append((safe_softmax(scores, dim=0), "that normalised over the batch: use dim=-1"))
    variants.append((torch.exp(scores), "exp alone: divide each row by its sum"))
    if not bool(full.any()):
        variants.append((torch.log_softmax(scores, -1), "that is log_softmax: return the probabilities"))

    def diagnose(got: torch.Tensor) -> str | None:
        if got.shape != scores.shape:
            return "keep the shape: the softmax of a row is a row of the same length"
        hint = next((h for want, h in variants if near(got, want)), None)
        if hint or not bool(full.any()):
            return hint
        rows = got[full]  # the rows with no visible key
        uniform = torch.full_like(rows, 1 / rows.shape[-1])
        if bool(torch.isfinite(rows).all()) and near(rows, uniform):
            return (
                "a row with no visible key came out uniform (1/S each): it must be all zeros. "
                "That happens when -inf is replaced by a large finite number such as -1e9"
            )
        if bool(torch.isfinite(rows).all()) and bool((rows != 0).any()):
            return "a row whose scores are all -inf must come out all zeros"
        return None

    return diagnose


def check_safe_softmax(fn) -> CheckReport:
    """fn(scores) must return softmax(scores, dim=-1), and all zeros in a row whose scores are
    all -inf, for very large scores too: lib.attention.safe_softmax."""
    g = torch.Generator().manual_seed(13)
    keep = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    causal_pad = combine_masks(causal_mask(3, kv_len=4), padding_mask(keep))  # (2, 1, 3, 4)
    full_row = _randn(g, 2, 3, 5, scale=3.0)
    full_row[0, 1] = NEG_INF  # query 1 of the first sequence sees no key
    full_row[1, 2, :2] = NEG_INF
    one_key = _randn(g, 4, 1)
    one_key[2, 0] = NEG_INF
    cases = []
    for name, scores in [
        ("ordinary scores, a (2, 5) matrix", _randn(g, 2, 5, scale=2.0)),
        ("(B, H, T, S) = (2, 2, 3, 4) scores with -inf entries (causal + padding)", _randn(g, 2, 2, 3, 4) + causal_pad),
        ("very large scores (±1000 and more), (3, 6)", _randn(g, 3, 6, scale=1000.0) + 2000.0),
        ("a row that is entirely -inf (a query with no visible key)", full_row),
        ("one key (S = 1), one of its rows -inf", one_key),
    ]:
        cases.append(Case(name, (scores,), safe_softmax(scores), **_TOL, diagnose=_diagnose_softmax(scores)))

    def nan_hint(case: Case) -> str:
        scores = case.args[0]
        if bool(torch.isneginf(scores).all(dim=-1).any()):
            return (
                "NaN in a row whose scores are all -inf: did a whole row get -inf? Its maximum "
                "is -inf, and -inf - (-inf) is NaN; its sum of exps is 0, and 0/0 is NaN. Give "
                "such a row zeros (use 0 as its maximum, or replace a zero sum by 1)"
            )
        if float(scores.max()) > 100:
            return "NaN from overflow: exp(1000) is inf and inf/inf is NaN; subtract each row's maximum before exp"
        return "NaN where the scores are finite: subtract each row's maximum, then exp, then divide by the sum"

    return run_checks("Step 1.3 (a softmax that survives -inf)", _on_copies(fn), cases, nan_hint=nan_hint)


# --------------------------------------------------------------------------- 1.4 attention weights
_WEIGHTS_STEPS = [("my_scores", check_scores, "Step 1.1"), ("my_safe_softmax", check_safe_softmax, "Step 1.3")]


def _diagnose_weights(q, k, mask, fn):
    scaled = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    variants = [
        (safe_softmax(scaled * math.sqrt(q.shape[-1]) + mask), "the scores were not scaled: divide QKᵀ by √D"),
        (safe_softmax(scaled + mask, dim=-2), "the softmax ran down the columns: normalise over the keys, dim=-1"),
        (safe_softmax(scaled), "the mask was not applied: add M to the scaled scores before the softmax"),
        (
            safe_softmax(scaled) * torch.isfinite(mask),
            "the mask was applied after the softmax: add it to the scores before, so that each row "
            "still sums to 1 over the visible keys",
        ),
    ]
    if scaled.shape[-2] == scaled.shape[-1]:  # T = S: a transposed mask still fits
        variants.append(
            (
                safe_softmax(scaled + mask.transpose(-2, -1)),
                "the mask was transposed: row i is query i and column j key j, so add M "
                "as it is (a (B, 1, 1, S) padding mask blocks keys, the columns, and "
                "broadcasts over the queries)",
            )
        )

    def diagnose(got: torch.Tensor) -> str | None:
        hint = next((h for want, h in variants if near(got, want)), None)
        return with_earlier(hint, fn, _WEIGHTS_STEPS)

    return diagnose


def check_attention_weights(fn) -> CheckReport:
    """fn(q (B, H, T, D), k (B, H, S, D), mask) must return softmax(QKᵀ/√D + M) over the keys,
    with all-zero rows where no key is visible: lib.attention.attention_weights, and
    all-MiniLM-L6-v2's own attention probabilities on a padded batch of real sentences."""
    name = "Step 1.4 (the attention weights)"
    g = torch.Generator().manual_seed(14)
    keep = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # left padding in row 0, right in row 1
    cases = []
    for case, (B, H, T, S, D), mask in [
        ("B = 2, H = 3, T = S = 5, causal", (2, 3, 5, 5, 8), causal_mask(5)),
        ("padding on both sides, (B, 1, 1, S) mask", (2, 2, 5, 5, 8), padding_mask(keep)),
        (
            "causal + left padding: the first query of row 0 sees no key",
            (2, 2, 5, 5, 8),
            combine_masks(causal_mask(5), padding_mask(keep)),
        ),
    ]:
        q, k = _randn(g, B, H, T, D), _randn(g, B, H, S, D)
        cases.append(
            Case(case, (q, k, mask), attention_weights(q, k, mask), **_TOL, diagnose=_diagnose_weights(q, k, mask, fn))
        )

    def nan_hint(case: Case) -> str:
        hint = (
            "NaN: did a whole row get -inf? A query that sees no key must get weights of zero, "
            "which is what Step 1.3's my_safe_softmax is for: build on it"
        )
        return with_earlier(hint, fn, [("my_safe_softmax", check_safe_softmax, "Step 1.3")])

    report = run_checks(name, _on_copies(fn), cases, nan_hint=nan_hint)
    if not report.passed:
        return unless_earlier_unfinished(report, fn, _WEIGHTS_STEPS)
    real = _minilm_attention()  # loaded only for an answer that passes the made-up cases
    real_cases = []
    for i, layer in real["layers"].items():
        q, k, mask = layer["q"], layer["k"], real["mask"]
        # transformers' eager attention: the same fp32 arithmetic in another order, and -3.4e38
        # instead of -inf at padding keys (weights exactly 0 either way); measured: 4e-7 apart
        real_cases.append(
            Case(
                f"all-MiniLM-L6-v2, layer {i}: its own q and k on a padded batch "
                "of 3 sentences, against transformers' attention probabilities",
                (q, k, mask),
                layer["probs"],
                **_TOL,
                diagnose=_diagnose_weights(q, k, mask, fn),
            )
        )
    report = run_checks(name, _on_copies(fn), real_cases, nan_hint=nan_hint)
    report.n_cases = len(cases) + len(real_cases)
    return report


# --------------------------------------------------------------------------- 1.5 attention
_ATTENTION_STEPS = [("my_attention_weights", check_attention_weights, "Step 1.4")] + _WEIGHTS_STEPS


def _zoo() -> list[tuple[str, tuple[int, ...], torch.Tensor]]:
    """Lesson 01's mask zoo, and packed documents, as (case, (B, H, T, S, D), additive mask)."""
    both_sides = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    source = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    return [
        ("T = S = 1", (1, 1, 1, 1, 8), torch.zeros(1, 1)),
        ("bidirectional (BERT): all zeros, B = 2, H = 3, T = S = 6", (2, 3, 6, 6, 8), torch.zeros(6, 6)),
        ("causal (GPT)", (2, 3, 6, 6, 8), causal_mask(6)),
        ("padding on both sides, (B, 1, 1, S)", (2, 2, 7, 7, 8), padding_mask(both_sides)),
        (
            "causal + left padding: two queries see no key at all",
            (2, 2, 6, 6, 8),
            combine_masks(causal_mask(6), padding_mask(left)),
        ),
        ("sliding window of 3 (Mistral)", (1, 2, 7, 7, 8), sliding_window_mask(7, 3)),
        ("local window of 2 on both sides (Longformer)", (1, 2, 7, 7, 8), sliding_window_mask(7, 2, causal=False)),
        ("prefix-LM, prefix of 3 (T5's prefix LM, UniLM)", (1, 2, 6, 6, 8), prefix_lm_mask(6, 3)),
        ("packed documents: block-diagonal, causal inside each", (2, 2, 8, 8, 8), document_mask(documents)),
        (
            "cross-attention: T = 3 decoder queries on S = 7 encoder keys with padding",
            (2, 2, 3, 7, 8),
            cross_attention_mask(source, 3),
        ),
        (
            "a decode step: T = 2 new queries on S = 6 cached keys, causal (bottom-right)",
            (1, 2, 2, 6, 8),
            causal_mask(2, kv_len=6),
        ),
    ]


def _diagnose_attention(q, k, v, mask, fn):
    B, H, T, D = q.shape
    S = k.shape[2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, T, S)
    weights = safe_softmax(scores + mask)
    own_triangle = combine_masks(mask, causal_mask(T, kv_len=S) if S >= T else None)
    variants = [
        (safe_softmax(scores * math.sqrt(D) + mask) @ v, "the scores were not scaled: divide QKᵀ by √D"),
        (safe_softmax(scores + mask, dim=-2) @ v, "the softmax ran over the queries: normalise over the keys, dim=-1"),
        (safe_softmax(scores) @ v, "the mask was not applied: add it to the scores before the softmax"),
        (
            safe_softmax(scores + own_triangle) @ v,
            "that adds a causal triangle of its own: the mask argument is the whole M "
            "(bidirectional, cross-attention and prefix-LM masks let a query see later keys)",
        ),
    ]
    if S == T:
        variants.append(
            (
                weights.transpose(-2, -1) @ v,
                "the weights were transposed: (B, H, T, S) @ (B, H, S, D), row i of the weights is query i",
            )
        )

    def diagnose(got: torch.Tensor) -> str | None:
        if got.shape == weights.shape and got.shape != (B, H, T, D):
            return "that is the weights' shape (B, H, T, S): multiply them by v, (B, H, T, S) @ (B, H, S, D)"
        hint = next((h for want, h in variants if near(got, want)), None)
        return with_earlier(hint, fn, _ATTENTION_STEPS)

    return diagnose


def check_attention(fn) -> CheckReport:
    """fn(q (B, H, T, D), k, v (B, H, S, D), mask) must equal lib.attention.attention_ref under
    every mask of lesson 01's zoo (and packed documents), rows with no visible key giving zeros,
    and on all-MiniLM-L6-v2's real q, k, v."""
    name = "Step 1.5 (attention, assembled)"
    g = torch.Generator().manual_seed(15)
    cases = []
    for case, (B, H, T, S, D), mask in _zoo():
        q, k, v = _randn(g, B, H, T, D), _randn(g, B, H, S, D), _randn(g, B, H, S, D)
        cases.append(
            Case(
                case,
                (q, k, v, mask),
                attention_ref(q, k, v, mask),
                **_TOL,
                diagnose=_diagnose_attention(q, k, v, mask, fn),
            )
        )
    q, k, v = _randn(g, 1, 2, 5, 16, scale=-60.0), _randn(g, 1, 2, 5, 16), _randn(g, 1, 2, 5, 16)
    mask = causal_mask(5)
    cases.append(
        Case(
            "very large scores (|QKᵀ/√D| up to ~200), causal",
            (q, k, v, mask),
            attention_ref(q, k, v, mask),
            **_TOL,
            diagnose=_diagnose_attention(q, k, v, mask, fn),
        )
    )

    def nan_hint(case: Case) -> str:
        if bool(torch.isneginf(case.args[3]).all(dim=-1).any()):
            hint = (
                "NaN: did a whole row get -inf? A query with no visible key must give a row of "
                "zeros: build on your my_safe_softmax (Step 1.3) or my_attention_weights "
                "(Step 1.4)"
            )
        else:
            hint = "NaN from exp() overflowing: subtract each row's maximum before exp (Step 1.3)"
        steps = [
            ("my_attention_weights", check_attention_weights, "Step 1.4"),
            ("my_safe_softmax", check_safe_softmax, "Step 1.3"),
        ]
        return with_earlier(hint, fn, steps)

    report = run_checks(name, _on_copies(fn), cases, nan_hint=nan_hint)
    if not report.passed:
        return unless_earlier_unfinished(report, fn, _ATTENTION_STEPS)
    real = _minilm_attention()  # loaded only for an answer that passes the made-up cases
    layer, mask = real["layers"][0], real["mask"]
    q, k, v = layer["q"], layer["k"], layer["v"]
    real_case = Case(
        "all-MiniLM-L6-v2, layer 0: its own q, k, v on a padded batch of 3 sentences",
        (q, k, v, mask),
        attention_ref(q, k, v, mask),
        **_TOL,
        diagnose=_diagnose_attention(q, k, v, mask, fn),
    )
    report = run_checks(name, _on_copies(fn), [real_case], nan_hint=nan_hint)
    report.n_cases = len(cases) + 1
    return report
