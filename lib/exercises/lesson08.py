"""Checks for lesson 08, "Architectures compared".

    check_recall_batch(fn)   fn(keys (B, P), values (B, P), asked (B, Q)) -> (idx, targets), equal to
                             lib.tasks.AssociativeRecall.layout: k v k v ... | q q ..., each query's
                             value as the target at the query's own position, -100 elsewhere
"""

from __future__ import annotations

import torch

from lib.exercises import CheckReport, call_learner
from lib.tasks import IGNORE, RECALL, AssociativeRecall

__all__ = ["check_recall_batch"]


def _case(batch: int, P: int, Q: int, seed: int, n_keys: int = 16):
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(batch, n_keys, generator=g).argsort(dim=1)[:, :P] + 2
    values = torch.randint(2 + n_keys, 2 + 2 * n_keys, (batch, P), generator=g)
    asked = torch.rand(batch, P, generator=g).argsort(dim=1)[:, :Q]
    return keys, values, asked


def check_recall_batch(fn) -> CheckReport:
    """fn(keys, values, asked) -> (idx, targets) as AssociativeRecall.layout."""
    name = "Exercise 8.1 (an associative-recall batch)"
    cases = [("one pair, one query", _case(1, 1, 1, 0)), ("4 pairs, 2 queries, batch 3", _case(3, 4, 2, 1)),
             ("8 pairs, all queried in random order", _case(2, 8, 8, 2))]
    for case, args in cases:
        got, report = call_learner(name, fn, args, case, len(cases))
        if report is not None:
            return report
        keys, values, asked = args
        idx, targets = AssociativeRecall.layout(keys, values, asked)

        def fail(problem, hint=None, case=case):
            return CheckReport(name, False, len(cases), case, problem, hint)

        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            return fail(f"returned {type(got).__name__}, expected a tuple (idx, targets) of tensors")
        g_idx, g_tgt = got
        if tuple(g_idx.shape) != tuple(idx.shape) or tuple(g_tgt.shape) != tuple(idx.shape):
            return fail(f"shapes {tuple(g_idx.shape)} and {tuple(g_tgt.shape)}, expected both {tuple(idx.shape)}",
                        "2P + 1 + Q positions: the P pairs as k v, one separator, then the Q queries")
        P = keys.shape[1]
        if not torch.equal(g_idx[:, :2 * P].long(), idx[:, :2 * P]):
            if torch.equal(g_idx[:, 0:2 * P:2].long(), values) and torch.equal(g_idx[:, 1:2 * P:2].long(), keys):
                return fail("the pairs are written value first", "each pair is the key, then its value: k v k v ...")
            return fail("the pairs part of idx is wrong", "idx[:, 0:2P:2] = keys and idx[:, 1:2P:2] = values")
        if not bool((g_idx[:, 2 * P] == RECALL).all()):
            return fail(f"no separator (token {RECALL}) right after the pairs", f"idx[:, 2P] = RECALL = {RECALL}")
        if not torch.equal(g_idx[:, 2 * P + 1:].long(), idx[:, 2 * P + 1:]):
            if torch.equal(g_idx[:, 2 * P + 1:].long(), values.gather(1, asked)):
                return fail("the queries are the values, not the keys", "a query asks with the key: keys.gather(1, asked)")
            return fail("the queries are wrong", "query j is the key of pair asked[:, j]: keys.gather(1, asked)")
        if torch.equal(g_tgt.long(), targets):
            continue
        shifted = torch.full_like(targets, IGNORE)
        shifted[:, 2 * P:-1] = targets[:, 2 * P + 1:]
        if torch.equal(g_tgt.long(), shifted):
            return fail("each value is placed one position early",
                        "the answer to a query is the token after it, so it is the target at the query's own position")
        answered = g_tgt != IGNORE
        if bool((g_tgt[:, :2 * P + 1] != IGNORE).any()):
            return fail("targets ask for answers before the queries",
                        f"only the query positions have a target; everything else is {IGNORE} (ignored by the loss)")
        if int(answered.sum()) and torch.equal(g_tgt[:, 2 * P + 1:].long(), keys.gather(1, asked)):
            return fail("the targets are the keys", "the target is the value paired with the asked key: values.gather(1, asked)")
        return fail("wrong targets", "targets[:, 2P + 1:] = values.gather(1, asked), and -100 everywhere else")
    return CheckReport(name, True, len(cases))
