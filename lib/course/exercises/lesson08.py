"""Checks for lesson 08, "Architectures compared".

check_recall_batch(fn)   fn(keys (B, P), values (B, P), asked (B, Q)) -> (idx, targets), equal to
                         lib.tasks.AssociativeRecall.layout: k v k v ... | q q ..., each query's
                         value as the target at the query's own position, -100 elsewhere
check_decode_state_bytes(fn)
                         fn(pattern, batch, context, d_model, d_state, d_conv, expand, bytes_per_elem)
                         -> int: the bytes a decoder of "A" (attention) and "M" (Mamba) layers
                         carries between tokens, as lib.decode.decode_state_bytes counts them
"""

from __future__ import annotations

import torch

from lib.course.exercises import CheckReport, call_learner
from lib.kv_cache import kv_cache_bytes
from lib.mamba import MambaConfig
from lib.mamba_lm import state_bytes
from lib.tasks import IGNORE, RECALL, AssociativeRecall

__all__ = ["check_decode_state_bytes", "check_recall_batch"]


def _case(batch: int, P: int, Q: int, seed: int, n_keys: int = 16):
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(batch, n_keys, generator=g).argsort(dim=1)[:, :P] + 2
    values = torch.randint(2 + n_keys, 2 + 2 * n_keys, (batch, P), generator=g)
    asked = torch.rand(batch, P, generator=g).argsort(dim=1)[:, :Q]
    return keys, values, asked


def check_recall_batch(fn) -> CheckReport:
    """fn(keys, values, asked) -> (idx, targets) as AssociativeRecall.layout."""
    name = "Exercise 8.1 (an associative-recall batch)"
    cases = [
        ("one pair, one query", _case(1, 1, 1, 0)),
        ("4 pairs, 2 queries, batch 3", _case(3, 4, 2, 1)),
        ("8 pairs, all queried in random order", _case(2, 8, 8, 2)),
    ]
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
            return fail(
                f"shapes {tuple(g_idx.shape)} and {tuple(g_tgt.shape)}, expected both {tuple(idx.shape)}",
                "2P + 1 + Q positions: the P pairs as k v, one separator, then the Q queries",
            )
        P = keys.shape[1]
        if not torch.equal(g_idx[:, : 2 * P].long(), idx[:, : 2 * P]):
            if torch.equal(g_idx[:, 0 : 2 * P : 2].long(), values) and torch.equal(
                g_idx[:, 1 : 2 * P : 2].long(), keys
            ):
                return fail("the pairs are written value first", "each pair is the key, then its value: k v k v ...")
            return fail("the pairs part of idx is wrong", "idx[:, 0:2P:2] = keys and idx[:, 1:2P:2] = values")
        if not bool((g_idx[:, 2 * P] == RECALL).all()):
            return fail(f"no separator (token {RECALL}) right after the pairs", f"idx[:, 2P] = RECALL = {RECALL}")
        if not torch.equal(g_idx[:, 2 * P + 1 :].long(), idx[:, 2 * P + 1 :]):
            if torch.equal(g_idx[:, 2 * P + 1 :].long(), values.gather(1, asked)):
                return fail(
                    "the queries are the values, not the keys", "a query asks with the key: keys.gather(1, asked)"
                )
            return fail("the queries are wrong", "query j is the key of pair asked[:, j]: keys.gather(1, asked)")
        if torch.equal(g_tgt.long(), targets):
            continue
        shifted = torch.full_like(targets, IGNORE)
        shifted[:, 2 * P : -1] = targets[:, 2 * P + 1 :]
        if torch.equal(g_tgt.long(), shifted):
            return fail(
                "each value is placed one position early",
                "the answer to a query is the token after it, so it is the target at the query's own position",
            )
        answered = g_tgt != IGNORE
        if bool((g_tgt[:, : 2 * P + 1] != IGNORE).any()):
            return fail(
                "targets ask for answers before the queries",
                f"only the query positions have a target; everything else is {IGNORE} (ignored by the loss)",
            )
        if int(answered.sum()) and torch.equal(g_tgt[:, 2 * P + 1 :].long(), keys.gather(1, asked)):
            return fail(
                "the targets are the keys", "the target is the value paired with the asked key: values.gather(1, asked)"
            )
        return fail("wrong targets", "targets[:, 2P + 1:] = values.gather(1, asked), and -100 everywhere else")
    return CheckReport(name, True, len(cases))


# --------------------------------------------------------------------------- 8.2 the decoding state
def decode_state_bytes_ref(
    pattern: str, batch: int, context: int, d_model: int, d_state: int, d_conv: int, expand: int, bytes_per_elem: int
) -> int:
    """The layers' own counts summed: an "A" layer's KV cache (lib.kv_cache.kv_cache_bytes, heads x head
    dim = d_model) and an "M" layer's state (lib.mamba_lm.state_bytes, counted in elements)."""
    mamba = MambaConfig(vocab_size=2, d_model=d_model, n_layers=1, d_state=d_state, d_conv=d_conv, expand=expand)
    per_layer = {
        "A": kv_cache_bytes(1, batch, context, 1, d_model, bytes_per_elem=bytes_per_elem),
        "M": state_bytes(mamba, batch, torch.float32) // 4 * bytes_per_elem,
    }
    return sum(per_layer[kind] for kind in pattern)


def _state_variants(pattern, batch, S, C, N, K, expand, b) -> dict[str, int]:
    """Plausible wrong counts, each with the hint that names its mistake."""
    E = expand * C

    def total(attn, mamba):
        return sum(attn if kind == "A" else mamba for kind in pattern)

    kv, ssm = 2 * batch * S * C * b, batch * E * (K - 1 + N) * b
    return {
        "a KV cache holds keys AND values: 2 · B · S · d_model numbers per attention layer": total(kv // 2, ssm),
        "a Mamba layer also keeps its short convolution's window, the last K - 1 inputs: E · (K - 1) numbers "
        "per sequence besides the E · N of the SSM state": total(kv, batch * E * N * b),
        "the convolution's window keeps K - 1 inputs, not K: the K-th is the next token itself, read at its "
        "step": total(kv, batch * E * (K + N) * b),
        "a Mamba layer's state lives in its inner width E = expand · d_model, not d_model": total(
            kv, batch * C * (K - 1 + N) * b
        ),
        "a Mamba layer's state does not grow with the context: the same bytes after 1 token or a million": total(
            kv, ssm * S
        ),
        "count each layer by its letter: only the 'A' layers keep a KV cache": total(kv, kv),
        "multiply by bytes_per_elem: the sizes count numbers, the answer is bytes": total(kv // b, ssm // b),
    }


def check_decode_state_bytes(fn) -> CheckReport:
    """fn(pattern, batch, context, d_model, d_state, d_conv, expand, bytes_per_elem) -> int bytes."""
    name = "Exercise 8.2 (what a hybrid carries while decoding)"
    cases = [
        ("the hybrid 'MMA', batch 3, 2,048 tokens, fp32", ("MMA", 3, 2048, 64, 16, 4, 2, 4)),
        ("one attention layer, one token, fp32", ("A", 1, 1, 64, 16, 4, 2, 4)),
        ("one Mamba layer after 1,000 tokens, fp32", ("M", 1, 1000, 64, 16, 4, 2, 4)),
        ("a GPT, 'AAAA', batch 2, 4,096 tokens, fp16", ("AAAA", 2, 4096, 64, 16, 4, 2, 2)),
        ("one attention layer in eight, 65,536 tokens, fp16", ("MMMAMMMM", 1, 65536, 256, 16, 4, 2, 2)),
        ("a one-number state (d_state 1), expand 3, 'MAM', 17 tokens", ("MAM", 2, 17, 32, 1, 4, 3, 4)),
    ]
    for case, args in cases:
        got, report = call_learner(name, fn, args, case, len(cases))
        if report is not None:
            return report
        expected = decode_state_bytes_ref(*args)
        if isinstance(got, bool) or not isinstance(got, int):
            return CheckReport(
                name,
                False,
                len(cases),
                case,
                f"returned {type(got).__name__}, expected an int",
                "bytes are a whole number: return an int (wrap the sum in int(...))",
            )
        if got != expected:
            hint = next(
                (h for h, wrong in _state_variants(*args).items() if got == wrong and wrong != expected),
                "sum over the layers: 'A' 2 · B · S · d_model, 'M' B · E · (K - 1 + N), each times "
                "bytes_per_elem, with E = expand · d_model",
            )
            return CheckReport(name, False, len(cases), case, f"returned {got:,}, expected {expected:,}", hint)
    return CheckReport(name, True, len(cases))
