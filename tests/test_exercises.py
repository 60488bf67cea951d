"""The exercise mechanism: checks fail on stubs with hints, pass on solutions, never raise; the
generated exercise notebooks are current and show hints, not tracebacks, when run unsolved."""

import importlib.util
import math
import subprocess
import sys
from functools import partial
from pathlib import Path

import nbformat
import pytest
import torch

from lib.attention import attention_ref
from lib.exercises import CheckReport
from lib.exercises.lesson01 import check_causal_mask, check_masked_attention
from lib.masks import causal_mask

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]-*.ipynb"))


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stub(*args):
    raise NotImplementedError


# ---------------------------------------------------------------- exercise 1.1
def test_causal_mask_check_passes_on_the_solution_and_fails_on_the_stub():
    assert check_causal_mask(causal_mask).passed
    report = check_causal_mask(stub)
    assert not report.passed and report.problem == "not attempted yet"
    assert "NotImplementedError" in repr(report)


@pytest.mark.parametrize(
    "wrong, hint_words",
    [
        (lambda T: torch.ones(T, T, dtype=torch.bool).tril(), "not True/False"),
        (lambda T: torch.full((T, T), float("-inf")).tril(diagonal=-1), "blocked the past"),
        (lambda T: torch.full((T, T), float("-inf")).triu(diagonal=0), "diagonal"),
        (lambda T: torch.full((T, T), -1e9).triu(diagonal=1), "-1e9"),
        (lambda T: torch.full((T, T), float("-inf")).triu(diagonal=1).double(), None),
        (lambda T: None, "return"),
    ],
)
def test_causal_mask_check_names_the_mistake(wrong, hint_words):
    report = check_causal_mask(wrong)
    assert not report.passed
    if hint_words:
        assert hint_words in (report.hint or "") + (report.problem or "")


# ---------------------------------------------------------------- exercise 1.2
def solution(q, k, v, mask):
    return attention_ref(q, k, v, mask)


def plain_softmax(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask, -1) @ v


def no_max_subtraction(q, k, v, mask):
    e = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask)
    return e / e.sum(-1, keepdim=True).clamp_min(1e-30) @ v


def unscaled(q, k, v, mask):
    return attention_ref(q, k, v, mask, scale=1.0)


def wrong_axis(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask, -2).nan_to_num(0.0) @ v


def mask_ignored(q, k, v, mask):
    return attention_ref(q, k, v)


def crashes(q, k, v, mask):
    return q @ k  # shape error for T != D


def test_masked_attention_check_passes_on_the_solution_and_fails_on_the_stub():
    assert check_masked_attention(solution).passed
    assert check_masked_attention(stub).problem == "not attempted yet"


@pytest.mark.parametrize(
    "wrong, words",
    [
        (plain_softmax, "did a whole row get -inf?"),
        (no_max_subtraction, "subtract each row's maximum"),
        (unscaled, "divide QKᵀ by √D"),
        (wrong_axis, "dim=-1"),
        (mask_ignored, "the mask was not applied"),
        (crashes, "raised RuntimeError"),
    ],
)
def test_masked_attention_check_gives_a_targeted_hint(wrong, words):
    report = check_masked_attention(wrong)
    assert isinstance(report, CheckReport) and not report.passed
    assert words in f"{report.problem} {report.hint}"


def test_a_check_given_a_non_function_explains_instead_of_raising():
    report = check_causal_mask(causal_mask(3))
    assert not report.passed and "without calling it" in report.hint


# ---------------------------------------------------------------- generated notebooks
def test_stub_generation_replaces_the_solution_block_at_its_indentation():
    tool = load_tool("make_exercises")
    src = "def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n\ncheck(f)"
    out = tool.stub_source(src, "test")
    assert "return x" not in out and "SOLUTION" not in out
    assert "    raise NotImplementedError" in out and out.endswith("check(f)")
    with pytest.raises(ValueError, match="without"):
        tool.stub_source("### BEGIN SOLUTION\nx = 1\n", "test")


def test_generated_exercise_notebooks_are_current():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_exercises.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def exercise_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code" and "check_" in c.source and "my_" in c.source]


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_holds_solutions_that_pass_their_checks(lesson):
    nb = nbformat.read(lesson, as_version=4)
    cells = exercise_cells(nb)
    assert cells, "every lesson has exercises"
    for cell in cells:
        assert "### BEGIN SOLUTION" in cell.source
        text = "".join(o.get("data", {}).get("text/plain", "") for o in cell.outputs)
        assert text.startswith("✔") and "passed all" in text, text


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_exercise_notebook_ships_unexecuted_with_stubs_for_every_solution(lesson):
    """The exercise version is the lesson with each solution replaced by a stub. It is executed in
    a real JupyterLab by tests/browser/test_lab.py, which checks every unsolved exercise answers
    with a hint and no cell raises (one execution there instead of a second one here)."""
    path = ROOT / "lessons" / "exercises" / lesson.name
    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "exercise notebooks ship unexecuted"
    assert "jupytext" not in nb.metadata, "no pairing: saving it must not create a .md"
    cells = exercise_cells(nb)
    assert cells and len(cells) == len(exercise_cells(nbformat.read(lesson, as_version=4)))
    for cell in cells:
        assert "### BEGIN SOLUTION" not in cell.source and "raise NotImplementedError" in cell.source


# ---------------------------------------------------------------- lesson 02
from lib.bert import mlm_corrupt  # noqa: E402
from lib.exercises.lesson02 import check_mlm_corrupt, check_padding_mask  # noqa: E402
from lib.masks import padding_mask  # noqa: E402


def test_padding_mask_check_passes_on_lib_and_fails_on_the_stub():
    assert check_padding_mask(padding_mask).passed
    assert check_padding_mask(stub).problem == "not attempted yet"


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda k: padding_mask(k)[:, 0, 0], "(B, 1, 1, T)"),
        (lambda k: padding_mask(1 - k), "inverted"),
        (lambda k: padding_mask(k).transpose(-1, -2), "queries"),
        (lambda k: k.bool()[:, None, None, :], "not True/False"),
    ],
)
def test_padding_mask_check_names_the_mistake(wrong, words):
    report = check_padding_mask(wrong)
    assert not report.passed and words in (report.hint or "")


def lib_corrupt(ids, mask_id, vocab, special, g):
    return mlm_corrupt(ids, mask_token_id=mask_id, vocab_size=vocab, special_token_ids=special, generator=g)


def only_mask(ids, mask_id, vocab, special, g):
    sel = (torch.rand(ids.shape, generator=g) < 0.15) & ~torch.isin(ids, torch.tensor(special))
    return torch.where(sel, mask_id, ids), torch.where(sel, ids, -100)


def selects_specials(ids, mask_id, vocab, special, g):
    sel = torch.rand(ids.shape, generator=g) < 0.15
    return torch.where(sel, mask_id, ids), torch.where(sel, ids, -100)


def in_place(ids, mask_id, vocab, special, g):
    corrupted, labels = lib_corrupt(ids, mask_id, vocab, special, g)
    ids.copy_(corrupted)
    return corrupted, labels


def no_ignore_labels(ids, mask_id, vocab, special, g):
    corrupted, _ = lib_corrupt(ids, mask_id, vocab, special, g)
    return corrupted, ids.clone()


def _corrupt(ids, mask_id, vocab, special, g, *, select=None, p=0.15, split=(0.8, 0.9), random_ids=None):
    """A parametrised corruption: the right one by default, each keyword a way to get it wrong."""
    not_special = ~torch.isin(ids, torch.tensor(special))
    sel = (select if select is not None else torch.rand(ids.shape, generator=g) < p) & not_special
    choice = torch.rand(ids.shape, generator=g)
    if random_ids is None:
        allowed = torch.ones(vocab, dtype=torch.bool)
        allowed[list(special)] = False
        candidates = allowed.nonzero().squeeze(1)
        random_ids = candidates[torch.randint(len(candidates), ids.shape, generator=g)]
    corrupted = torch.where(sel & (choice < split[0]), mask_id, ids)
    corrupted = torch.where(sel & (choice >= split[0]) & (choice < split[1]), random_ids, corrupted)
    return corrupted, torch.where(sel, ids, -100)


def every_7th(ids, mask_id, vocab, special, g):  # the right average and even columns, a fixed pattern
    select = (torch.arange(ids.numel()).view(ids.shape) % 7 == 0) | (torch.rand(ids.shape, generator=g) < 0.0085)
    return _corrupt(ids, mask_id, vocab, special, g, select=select)


def every_7th_position(ids, mask_id, vocab, special, g):  # positions 0, 7, 14, ... of every sequence
    select = (torch.arange(ids.shape[1]) % 7 == 0).expand(ids.shape) | (torch.rand(ids.shape, generator=g) < 0.0085)
    return _corrupt(ids, mask_id, vocab, special, g, select=select)


def one_random_token(ids, mask_id, vocab, special, g):
    return _corrupt(ids, mask_id, vocab, special, g, random_ids=torch.full_like(ids, 2000))


def random_from_specials(ids, mask_id, vocab, special, g):  # [PAD], [CLS] or [SEP] as the "random" token
    others = torch.tensor([t for t in special if t != mask_id])
    pick = others[torch.randint(len(others), ids.shape, generator=g)]
    return _corrupt(ids, mask_id, vocab, special, g, random_ids=pick)


def ignores_the_generator(ids, mask_id, vocab, special, g):
    return _corrupt(ids, mask_id, vocab, special, torch.Generator().manual_seed(torch.seed() % 2**31))


def test_mlm_corrupt_check_fails_plausible_wrong_answers_by_name():
    """Each passes the average shares the old check looked at, or misses them by a little."""
    assert check_mlm_corrupt(_corrupt).passed  # the parametrised corruption, unchanged, is right
    for wrong, words in [
        (every_7th, "position to position"),
        (every_7th_position, "position to position"),
        (one_random_token, "spread evenly"),
        (random_from_specials, "special token"),
        (partial(_corrupt, p=0.141), "of the non-special tokens were selected, expected 15%"),
        (partial(_corrupt, p=0.159), "of the non-special tokens were selected, expected 15%"),
        (partial(_corrupt, split=(0.786, 0.886)), "expected 80% / 10% / 10%"),
        (ignores_the_generator, "generator"),
    ]:
        report = check_mlm_corrupt(wrong)
        assert not report.passed and words in f"{report.problem} {report.hint}", (wrong, report)


def test_mlm_corrupt_check_passes_on_lib_and_fails_on_the_stub():
    assert check_mlm_corrupt(lib_corrupt).passed
    assert check_mlm_corrupt(stub).problem == "not attempted yet"


@pytest.mark.parametrize(
    "wrong, words",
    [
        (only_mask, "below 0.8"),
        (selects_specials, "special"),
        (in_place, "clone"),
        (no_ignore_labels, "special"),
        (lambda *a: a[0], "tuple"),
    ],
)
def test_mlm_corrupt_check_names_the_mistake(wrong, words):
    report = check_mlm_corrupt(wrong)
    assert not report.passed and words in f"{report.problem} {report.hint}"


# ---------------------------------------------------------------- lesson 03
from lib.exercises.lesson03 import check_clm_loss, check_rope, check_top_p_filter  # noqa: E402
from lib.gpt import clm_loss  # noqa: E402
from lib.rope import apply_rope, rope_cos_sin  # noqa: E402
from lib.sampling import top_p_filter  # noqa: E402


def _lib_rope(x, positions):
    return apply_rope(x, *rope_cos_sin(len(positions), x.shape[-1], offset=int(positions[0])))


def test_lesson03_checks_pass_on_lib_and_fail_on_the_stub():
    for check, solution in ((check_clm_loss, clm_loss), (check_top_p_filter, top_p_filter), (check_rope, _lib_rope)):
        assert check(solution).passed, check(solution)
        report = check(stub)
        assert not report.passed and "not attempted" in repr(report)


def _unshifted(logits, idx):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))


def _summed(logits, idx):
    return clm_loss(logits, idx) * idx.shape[0] * (idx.shape[1] - 1)


@pytest.mark.parametrize("wrong, words", [(_unshifted, "no shift"), (_summed, "sum")])
def test_clm_loss_check_names_the_mistake(wrong, words):
    report = check_clm_loss(wrong)
    assert not report.passed and words in report.hint, report


def _top_p_strict(logits, p):  # keeps only tokens whose running total stays below p: one too few
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, probs.cumsum(-1) < p)
    return logits.masked_fill(~keep, float("-inf"))


def _top_p_probs(logits, p):  # returns probabilities instead of logits
    return top_p_filter(logits, p).softmax(-1).log()


@pytest.mark.parametrize("wrong, words", [(_top_p_strict, "too few"), (_top_p_probs, "logits themselves")])
def test_top_p_check_names_the_mistake(wrong, words):
    report = check_top_p_filter(wrong)
    assert not report.passed and words in report.hint, report


def _rope_interleaved(x, positions):
    D = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = (positions.double()[:, None] * theta[None, :]).repeat_interleave(2, dim=-1)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return (x.double() * angles.cos() + torch.cat([-x2, x1], dim=-1).double() * angles.sin()).float()


@pytest.mark.parametrize("wrong, words", [(_rope_interleaved, "repeat-interleaved"), (lambda x, p: x, "equals the input")])
def test_rope_check_names_the_mistake(wrong, words):
    report = check_rope(wrong)
    assert not report.passed and words in report.hint, report


# ---------------------------------------------------------------- lesson 04
from lib.exercises.lesson04 import check_cache_update, check_kv_cache_bytes  # noqa: E402
from lib.kv_cache import kv_cache_bytes  # noqa: E402


def _lib_update(k_cache, v_cache, start, k, v):
    end = start + k.shape[2]
    k_cache[:, :, start:end], v_cache[:, :, start:end] = k, v
    return k_cache[:, :, :end], v_cache[:, :, :end]


def test_lesson04_checks_pass_on_lib_and_fail_on_the_stub():
    assert check_kv_cache_bytes(lambda *a: kv_cache_bytes(*a[:5], bytes_per_elem=a[5])).passed
    assert check_cache_update(_lib_update).passed
    for check in (check_kv_cache_bytes, check_cache_update):
        report = check(stub)
        assert not report.passed and "not attempted" in repr(report)


@pytest.mark.parametrize("wrong, words", [
    (lambda L, B, S, H, D, b: L * B * S * H * D * b, "keys AND values"),
    (lambda L, B, S, H, D, b: 2 * L * B * S * H * D, "multiply by bytes_per_elem"),
    (lambda L, B, S, H, D, b: float(2 * L * B * S * H * D * b), "int"),
])
def test_kv_cache_bytes_check_names_the_mistake(wrong, words):
    report = check_kv_cache_bytes(wrong)
    assert not report.passed and words in (report.hint or "") + (report.problem or ""), report


def _returns_new_only(k_cache, v_cache, start, k, v):
    _lib_update(k_cache, v_cache, start, k, v)
    return k, v


def _not_in_place(k_cache, v_cache, start, k, v):
    return _lib_update(k_cache.clone(), v_cache.clone(), start, k, v)


def _returns_copies(k_cache, v_cache, start, k, v):
    k_all, v_all = _lib_update(k_cache, v_cache, start, k, v)
    return k_all.clone(), v_all.clone()


def _returns_concatenated(k_cache, v_cache, start, k, v):
    _lib_update(k_cache, v_cache, start, k, v)
    return torch.cat([k_cache[:, :, :start], k], dim=2), torch.cat([v_cache[:, :, :start], v], dim=2)


@pytest.mark.parametrize("wrong, words", [(_returns_new_only, "every position so far"), (_not_in_place, "in place"),
                                          (_returns_copies, "return views"), (_returns_concatenated, "return views")])
def test_cache_update_check_names_the_mistake(wrong, words):
    report = check_cache_update(wrong)
    assert not report.passed and words in report.hint, report


# ---------------------------------------------------------------- lesson 05
import triton  # noqa: E402  (after lib, which switches triton to its interpreter without a GPU)
import triton.language as tl  # noqa: E402

from lib.attention import online_softmax_update  # noqa: E402
from lib.exercises.lesson05 import (check_key_block_bounds, check_online_softmax_update,  # noqa: E402
                                    check_row_logsumexp)
from lib.kernels import key_block_bounds  # noqa: E402


@triton.jit
def _lse_kernel(X, OUT, n_cols, stride_row, BLOCK: tl.constexpr, TAIL: tl.constexpr, STABLE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_row + cols, mask=cols < n_cols, other=TAIL)
    if STABLE:
        m = tl.max(x, axis=0)
        tl.store(OUT + row, m + tl.log(tl.sum(tl.exp(x - m), axis=0)))
    else:
        tl.store(OUT + row, tl.log(tl.sum(tl.exp(x), axis=0)))


def _lse(tail=float("-inf"), stable=True):
    def run(x):
        out = torch.empty(x.shape[0], device=x.device)
        _lse_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=triton.next_power_of_2(x.shape[1]),
                                   TAIL=tail, STABLE=stable)
        return out
    return run


def test_lesson05_checks_pass_on_lib_and_fail_on_the_stub():
    assert check_online_softmax_update(online_softmax_update).passed
    assert check_key_block_bounds(key_block_bounds).passed
    assert check_row_logsumexp(_lse()).passed
    for check in (check_online_softmax_update, check_key_block_bounds, check_row_logsumexp):
        report = check(stub)
        assert not report.passed and "not attempted" in repr(report)


def test_a_stub_inside_a_triton_kernel_reads_as_not_attempted():
    @triton.jit
    def unfinished(X, OUT):
        raise NotImplementedError

    def run(x):
        unfinished[(1,)](x, torch.empty(1))
        return torch.empty(x.shape[0])

    report = check_row_logsumexp(run)
    assert not report.passed and "not attempted" in repr(report), report


def _no_rescale_l(m, l, acc, s, v):
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    p, c = torch.exp(s - safe), torch.exp(m - safe)
    return m_new, l + p.sum(-1, keepdim=True), acc * c + p @ v


def _no_rescale_acc(m, l, acc, s, v):
    m_new, l_new, _ = online_softmax_update(m, l, acc, s, v)
    safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    return m_new, l_new, acc + torch.exp(s - safe) @ v


def _normalised(m, l, acc, s, v):
    m_new, l_new, acc_new = online_softmax_update(m, l, acc, s, v)
    return m_new, l_new, acc_new / l_new


def _unguarded(m, l, acc, s, v):
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    p, c = torch.exp(s - m_new), torch.exp(m - m_new)
    return m_new, l * c + p.sum(-1, keepdim=True), acc * c + p @ v


@pytest.mark.parametrize("wrong, words", [
    (_no_rescale_l, "multiply l by exp(m_old - m_new)"),
    (_no_rescale_acc, "rescale the old acc"),
    (_normalised, "keep acc unnormalised"),
    (_unguarded, "exp(-inf - (-inf)) is NaN"),
])
def test_online_softmax_check_names_the_mistake(wrong, words):
    report = check_online_softmax_update(wrong)
    assert not report.passed and words in report.hint, report


@pytest.mark.parametrize("wrong, words", [
    (lambda i, T, bm, bn, c: key_block_bounds(i, T, bm, bn, c) if not c else
     ((i * bm) // bn, min((i + 1) * bm, T) // bn), "one key block short"),
    (lambda i, T, bm, bn, c: key_block_bounds(i, T, bm, bn, c) if c else (-(-T // bn), -(-T // bn)),
     "partial last key block"),
    (lambda i, T, bm, bn, c: key_block_bounds(i, T, bm, bn, c) if not c else  # n_end not capped at T
     (key_block_bounds(i, T, bm, bn, c)[0], -(-((i + 1) * bm) // bn)), "capped at T - 1"),
    (lambda i, T, bm, bn, c: key_block_bounds(i, T, bm, bn, c) if not c else
     (key_block_bounds(i, T, bm, bn, c)[1], key_block_bounds(i, T, bm, bn, c)[1]), "element mask"),
    (lambda i, T, bm, bn, c: (T // bn, -(-T // bn)), "skip them"),
])
def test_key_block_bounds_check_names_the_mistake(wrong, words):
    report = check_key_block_bounds(wrong)
    assert not report.passed and words in report.hint, report


@pytest.mark.parametrize("wrong, words", [
    (_lse(tail=0.0), "other=float('-inf')"),
    (_lse(stable=False), "tl.max(x) first"),
])
def test_row_logsumexp_check_names_the_mistake(wrong, words):
    report = check_row_logsumexp(wrong)
    assert not report.passed and words in report.hint, report


# ---------------------------------------------------------------- lesson 06
from lib.exercises.lesson06 import check_discretize, check_scan_combine, check_ssm_step  # noqa: E402
from lib.scan import discretize, scan_combine  # noqa: E402


def _lib_step(h, x, delta, A, B, C):
    h_next = torch.exp(delta.unsqueeze(-1) * A) * h + (delta * x).unsqueeze(-1) * B.unsqueeze(1)
    return (h_next * C.unsqueeze(1)).sum(-1), h_next


def test_lesson06_checks_pass_on_lib_and_fail_on_the_stub():
    assert check_discretize(discretize).passed
    assert check_ssm_step(_lib_step).passed
    assert check_scan_combine(scan_combine).passed
    for check in (check_discretize, check_ssm_step, check_scan_combine):
        report = check(stub)
        assert not report.passed and "not attempted" in repr(report)


@pytest.mark.parametrize("check, wrong, words", [
    (check_discretize, lambda d, A, B: (1 + d.unsqueeze(-1) * A, d.unsqueeze(-1) * B.unsqueeze(-2)), "Euler"),
    (check_discretize, lambda d, A, B: (torch.exp(d.unsqueeze(-1) * A), B.unsqueeze(-2).expand(*d.shape, -1)), "Δ·B"),
    (check_ssm_step, lambda h, x, d, A, B, C: _lib_step(h, x / d, d, A, B, C), "multiply x by Δ"),
    (check_ssm_step, lambda h, x, d, A, B, C: ((h * C.unsqueeze(1)).sum(-1), _lib_step(h, x, d, A, B, C)[1]),
     "not the old h"),
    (check_scan_combine, lambda l, r: (l[0] * r[0], l[0] * r[1] + l[1]), "left happens first"),
])
def test_lesson06_checks_name_the_mistake(check, wrong, words):
    report = check(wrong)
    assert not report.passed and words in report.hint, report


# ---------------------------------------------------------------- lesson 07
from lib.exercises.lesson07 import check_balance_loss, check_expert_capacity, check_top_k_gating  # noqa: E402
from lib.moe import expert_capacity, load_balancing_loss  # noqa: E402


def _gating(logits, k):
    top = logits.topk(k, dim=-1)
    return torch.softmax(top.values, dim=-1), top.indices


def test_lesson07_checks_pass_on_lib_and_fail_on_the_stub():
    assert check_top_k_gating(_gating).passed
    assert check_balance_loss(load_balancing_loss).passed
    assert check_expert_capacity(expert_capacity).passed
    for check in (check_top_k_gating, check_balance_loss, check_expert_capacity):
        report = check(stub)
        assert not report.passed and "not attempted" in repr(report)


@pytest.mark.parametrize("check, wrong, words", [
    (check_top_k_gating, lambda l, k: (torch.softmax(l, -1).gather(1, l.topk(k, -1).indices), l.topk(k, -1).indices),
     "full softmax"),
    (check_top_k_gating, lambda l, k: (_gating(l, k)[0], l.topk(k, -1, largest=False).indices), "k largest"),
    (check_balance_loss, lambda l, k: load_balancing_loss(l, k) / l.shape[1], "multiply by E"),
    (check_balance_loss, lambda l, k: load_balancing_loss(l, k) / k, "Σ f_i = k"),
    (check_expert_capacity, lambda N, E, k, C: int(C * N * k / E), "round up"),
    (check_expert_capacity, lambda N, E, k, C: -(-int(C * N) // E), "k assignments"),
    (check_expert_capacity, lambda N, E, k, C: math.ceil(C * N / E) * k, "before rounding up"),  # 8 at (10, 3, 2, 1)
    (check_expert_capacity, lambda N, E, k, C: math.ceil(C * N * k / E), "float rounding"),  # 12 at (100, 10, 1, 1.1)
])
def test_lesson07_checks_name_the_mistake(check, wrong, words):
    report = check(wrong)
    assert not report.passed and words in report.hint, report


# --------------------------------------------------------------------------- lesson 08
from lib.exercises.lesson08 import check_recall_batch  # noqa: E402
from lib.tasks import AssociativeRecall  # noqa: E402


def test_lesson08_check_passes_on_lib_and_fails_on_the_stub():
    assert check_recall_batch(AssociativeRecall.layout).passed

    def stub(keys, values, asked):
        raise NotImplementedError
    report = check_recall_batch(stub)
    assert not report.passed and "not attempted" in report.problem


def _value_first(keys, values, asked):
    return AssociativeRecall.layout(values, keys, asked)


def _early(keys, values, asked):
    idx, targets = AssociativeRecall.layout(keys, values, asked)
    return idx, torch.cat([targets[:, 1:], torch.full_like(targets[:, :1], -100)], dim=1)


def _targets_are_keys(keys, values, asked):
    idx, targets = AssociativeRecall.layout(keys, values, asked)
    targets[:, 2 * keys.shape[1] + 1:] = keys.gather(1, asked)
    return idx, targets


def _no_separator(keys, values, asked):
    idx, targets = AssociativeRecall.layout(keys, values, asked)
    idx[:, 2 * keys.shape[1]] = 0
    return idx, targets


@pytest.mark.parametrize("wrong, words", [(_value_first, "value first"), (_early, "one position early"),
                                          (_targets_are_keys, "targets are the keys"), (_no_separator, "separator")])
def test_recall_batch_check_names_the_mistake(wrong, words):
    report = check_recall_batch(wrong)
    assert not report.passed and words in report.problem
