"""Build track 01 (attention from nothing): each check passes a correct solution, refuses the stub,
and names the mistake in at least three plausible wrong versions; a later step names the earlier
step whose function it calls and which is wrong; step 1.4 really compares with all-MiniLM-L6-v2."""

import math

import torch

import lib.course.exercises.build01 as checks
from lib.attention import attention_ref, attention_weights, safe_softmax

NEG_INF = float("-inf")


# ---------------------------------------------------------------- solutions, as a student would
def my_scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def my_document_mask(doc_ids):
    T = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    past = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.zeros(same.shape).masked_fill(~(same & past), NEG_INF)[:, None]


def my_safe_softmax(scores):
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(scores - m)
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def my_attention_weights(q, k, mask):
    return my_safe_softmax(my_scores(q, k) + mask)


def my_attention(q, k, v, mask):
    return my_attention_weights(q, k, mask) @ v


SOLUTIONS = {
    "check_scores": my_scores,
    "check_document_mask": my_document_mask,
    "check_safe_softmax": my_safe_softmax,
    "check_attention_weights": my_attention_weights,
    "check_attention": my_attention,
}


# ---------------------------------------------------------------- wrong versions
def _scaled(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def _doc(doc_ids, same=True, causal=True, op="and", diagonal=True):
    T = doc_ids.shape[1]
    s = doc_ids[:, :, None] == doc_ids[:, None, :]
    p = torch.ones(T, T, dtype=torch.bool).tril(0 if diagonal else -1).expand_as(s)
    keep = {"and": (s if same else True) & (p if causal else True), "or": s | p}[op]
    keep = torch.as_tensor(keep).expand_as(s)
    return torch.zeros(s.shape).masked_fill(~keep, NEG_INF)[:, None]


def _no_max_subtraction(s):
    e = torch.exp(s)
    return e / e.sum(-1, keepdim=True)


def _max_without_guard(s):
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


WRONG_VERSIONS = {
    "check_scores": [
        (lambda q, k: q @ k.transpose(-2, -1), "not scaled"),
        (lambda q, k: q @ k.transpose(-2, -1) / q.shape[-1], "divides by D"),
        (lambda q, k: k @ q.transpose(-2, -1) / math.sqrt(q.shape[-1]), "rows must be the queries"),
        (lambda q, k: q @ k.transpose(-2, -1) / math.sqrt(q.shape[-2]), "divides by √T"),
        (lambda q, k: q.transpose(-2, -1) @ k / math.sqrt(q.shape[-1]), "the dot product runs over D"),
        (lambda q, k: torch.softmax(_scaled(q, k), -1), "already a softmax"),
    ],
    "check_document_mask": [
        (lambda ids: _doc(ids, causal=False), "later tokens of its own document"),
        (lambda ids: _doc(ids, same=False), "earlier documents"),
        (lambda ids: _doc(ids, op="or"), "AND"),
        (lambda ids: _doc(ids, diagonal=False), "must see itself"),
        (lambda ids: torch.isfinite(_doc(ids)), "not True/False"),
        (lambda ids: _doc(ids)[:, 0], "add the head dimension"),
        (lambda ids: _doc(ids).clamp_min(-1e9), "not -1e9"),
    ],
    "check_safe_softmax": [
        (lambda s: torch.softmax(s, -1), "did a whole row get -inf?"),
        (_no_max_subtraction, "subtract each row's maximum"),
        (_max_without_guard, "did a whole row get -inf?"),
        (lambda s: torch.softmax(s.masked_fill(torch.isneginf(s), -1e9), -1), "uniform"),
        (lambda s: safe_softmax(s, dim=-2), "dim=-1"),
        (torch.exp, "divide each row by its sum"),
    ],
    "check_attention_weights": [
        (lambda q, k, m: safe_softmax(q @ k.transpose(-2, -1) + m), "not scaled"),
        (lambda q, k, m: torch.softmax(_scaled(q, k) + m, -1), "did a whole row get -inf?"),
        (lambda q, k, m: safe_softmax(_scaled(q, k)), "the mask was not applied"),
        (lambda q, k, m: safe_softmax(_scaled(q, k)) * torch.isfinite(m), "after the softmax"),
        (lambda q, k, m: safe_softmax(_scaled(q, k) + m.transpose(-2, -1)), "transposed"),
        (lambda q, k, m: safe_softmax(_scaled(q, k) + m, dim=-2), "dim=-1"),
    ],
    "check_attention": [
        (lambda q, k, v, m: torch.softmax(_scaled(q, k) + m, -1) @ v, "did a whole row get -inf?"),
        (lambda q, k, v, m: safe_softmax(q @ k.transpose(-2, -1) + m) @ v, "not scaled"),
        (lambda q, k, v, m: safe_softmax(_scaled(q, k) + m), "multiply them by v"),
        (lambda q, k, v, m: attention_ref(q, k, v, m, causal=True), "causal triangle"),
        (lambda q, k, v, m: safe_softmax(_scaled(q, k) + m).transpose(-2, -1) @ v, "transposed"),
        (lambda q, k, v, m: safe_softmax(_scaled(q, k)) @ v, "the mask was not applied"),
    ],
}


# ---------------------------------------------------------------- later steps name the earlier one
def _notebook(source: str, **names) -> dict:
    """A notebook's namespace: `source` run with `names` already defined (earlier cells)."""
    namespace = dict(names, __name__="__main__", torch=torch, math=math)
    exec(source, namespace)
    return namespace


def test_the_weights_check_names_step_1_1_when_my_scores_is_wrong():
    nb = _notebook(
        "def my_attention_weights(q, k, mask):\n    return my_safe_softmax(my_scores(q, k) + mask)\n",
        my_scores=lambda q, k: q @ k.transpose(-2, -1),
        my_safe_softmax=my_safe_softmax,
    )
    report = checks.check_attention_weights(nb["my_attention_weights"])
    assert not report.passed and "Step 1.1" in report.hint and "not scaled" in report.hint, report


def test_the_attention_check_names_step_1_3_when_my_safe_softmax_is_wrong():
    nb = _notebook(
        "def my_attention(q, k, v, mask):\n    return my_safe_softmax(my_scores(q, k) + mask) @ v\n",
        my_scores=my_scores,
        my_safe_softmax=lambda s: torch.softmax(s, -1),
    )
    report = checks.check_attention(nb["my_attention"])
    assert not report.passed and "Step 1.3" in report.hint, report


def test_a_correct_earlier_step_is_not_blamed():
    nb = _notebook(
        "def my_attention(q, k, v, mask):\n    return my_safe_softmax(my_scores(q, k)) @ v\n",
        my_scores=my_scores,
        my_safe_softmax=my_safe_softmax,
    )
    report = checks.check_attention(nb["my_attention"])
    assert not report.passed and "mask was not applied" in report.hint, report
    assert "Step 1." not in report.hint, report


def test_a_step_written_on_an_unwritten_one_names_that_step():
    def unwritten(*args):
        raise NotImplementedError

    nb = _notebook(
        "def my_attention(q, k, v, mask):\n    return my_safe_softmax(my_scores(q, k) + mask) @ v\n",
        my_scores=my_scores,
        my_safe_softmax=unwritten,
    )
    report = checks.check_attention(nb["my_attention"])
    assert report.problem == "not attempted yet" and "Step 1.3" in report.hint, report
    assert "not written yet" in report.hint


# ---------------------------------------------------------------- the real model
def test_step_1_4_compares_with_minilm_attention_probabilities_from_transformers():
    real = checks._minilm_attention()
    assert bool((real["keep"] == 0).any()), "the batch must hold padding"
    for layer in real["layers"].values():
        B, H, T, D = layer["q"].shape
        assert (H, D) == (12, 32) and layer["probs"].shape == (B, H, T, T)
        ours = attention_weights(layer["q"], layer["k"], real["mask"])
        assert (ours - layer["probs"]).abs().max().item() <= 1e-5


def test_step_1_4_fails_an_answer_right_only_on_made_up_numbers():
    def right_on_random_inputs(q, k, mask):  # wrong at MiniLM's head size D = 32 only
        w = attention_weights(q, k, mask)
        return w.roll(1, dims=-1) if q.shape[-1] == 32 else w

    report = checks.check_attention_weights(right_on_random_inputs)
    assert not report.passed and "all-MiniLM-L6-v2" in report.failed_case, report


def test_checks_do_not_raise_on_answers_of_any_shape():
    for check in (
        checks.check_scores,
        checks.check_document_mask,
        checks.check_safe_softmax,
        checks.check_attention_weights,
        checks.check_attention,
    ):
        for answer in (torch.zeros(3), torch.zeros(2, 2, dtype=torch.bool), None, (1, 2)):
            report = check(lambda *a, answer=answer: answer)
            assert not report.passed
