"""Build track 04's checks: each passes its solution, refuses the stub, and names the mistake in
at least three plausible wrong versions; the loop's check drives lib's tiny Llama, one built from
the learner's own cache and attention layer, and SmolLM2-135M."""

import math
import types

import torch
import torch.nn as nn

import lib.course.exercises.build04 as checks
from lib.kv_cache import kv_cache_bytes
from lib.llama import LlamaConfig
from lib.rope import apply_rope, rope_cos_sin


# --------------------------------------------------------------------------- the solutions
class MyKVCache:
    def __init__(self, B, H_kv, T_max, D, dtype=torch.float32):
        self.k = torch.zeros(B, H_kv, T_max, D, dtype=dtype)
        self.v = torch.zeros(B, H_kv, T_max, D, dtype=dtype)

    def update(self, start, k, v):
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def my_cached_attention(q, k, v):
    B, H, T, D = q.shape
    S = k.shape[2]
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    future = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


class MyCachedAttention(nn.Module):
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
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return q, k, v

    def rope(self, T, start):
        return rope_cos_sin(T, self.head_dim, base=self.rope_base, offset=start)

    def out(self, y):
        B, H, T, D = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))

    def forward(self, x, cache=None, start=0):
        q, k, v = self.heads(x)
        cos, sin = self.rope(x.shape[1], start)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(start, k, v)
        return self.out(my_cached_attention(q, k, v))


def my_generate(model, idx, max_new_tokens):
    B, T = idx.shape
    caches = model.new_caches(B, T + max_new_tokens)
    logits = model(idx, caches=caches, start=0)[:, -1]
    out, chosen_by = [idx], []
    for i in range(max_new_tokens):
        chosen_by.append(logits)
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        if i < max_new_tokens - 1:
            logits = model(nxt, caches=caches, start=T + i)[:, -1]
    return torch.cat(out, dim=1), torch.stack(chosen_by, dim=1)


def my_cache_bytes(cfg, B, T, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.n_layer * B * T * cfg.n_kv_head * cfg.head_dim * size


SOLUTIONS = {
    "check_kv_cache": MyKVCache,
    "check_cached_attention": my_cached_attention,
    "check_cached_layer": MyCachedAttention,
    "check_cached_generate": my_generate,
    "check_cache_bytes": my_cache_bytes,
}


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


# --------------------------------------------------------------------------- wrong versions: 4.1
class WritesOneLate(MyKVCache):
    def update(self, start, k, v):
        end = start + k.shape[2]
        self.k[:, :, start + 1 : end + 1] = k
        self.v[:, :, start + 1 : end + 1] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class ReturnsWholeBuffer(MyKVCache):
    def update(self, start, k, v):
        super().update(start, k, v)
        return self.k, self.v


class ReturnsOnlyNew(MyKVCache):
    def update(self, start, k, v):
        super().update(start, k, v)
        return k, v


class GrowsByConcatenation:
    def __init__(self, B, H_kv, T_max, D, dtype=torch.float32):
        self.k = torch.zeros(B, H_kv, 0, D, dtype=dtype)
        self.v = torch.zeros(B, H_kv, 0, D, dtype=dtype)

    def update(self, start, k, v):
        self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        return self.k, self.v


class SwapsKeysAndValues(MyKVCache):
    def update(self, start, k, v):
        return super().update(start, v, k)


class IgnoresDtype(MyKVCache):
    def __init__(self, B, H_kv, T_max, D, dtype=torch.float32):
        super().__init__(B, H_kv, T_max, D)


class ReturnsCopies(MyKVCache):
    def update(self, start, k, v):
        k_all, v_all = super().update(start, k, v)
        return k_all.clone(), v_all.clone()


class PositionsFirst(MyKVCache):
    def __init__(self, B, H_kv, T_max, D, dtype=torch.float32):
        self.k = torch.zeros(B, T_max, H_kv, D, dtype=dtype)
        self.v = torch.zeros(B, T_max, H_kv, D, dtype=dtype)


class AppendsAtItsOwnPointer(MyKVCache):
    """Ignores start and writes after its own last write: right until a caller rewinds."""

    def __init__(self, B, H_kv, T_max, D, dtype=torch.float32):
        super().__init__(B, H_kv, T_max, D, dtype)
        self.length = 0

    def update(self, start, k, v):
        k_all, v_all = super().update(self.length, k, v)
        self.length += k.shape[2]
        return k_all, v_all


# --------------------------------------------------------------------------- 4.2
def attention_repeat(q, k, v):
    return checks.attend(q, k, v, expand="repeat")


def attention_mask_from_start(q, k, v):
    return checks.attend(q, k, v, mask="start")


def attention_no_mask(q, k, v):
    return checks.attend(q, k, v, mask="none")


def attention_unscaled(q, k, v):
    return checks.attend(q, k, v, scale=False)


def attention_diagonal_masked(q, k, v):
    B, H, T, D = q.shape
    S = k.shape[2]
    k, v = k.repeat_interleave(H // k.shape[1], dim=1), v.repeat_interleave(H // v.shape[1], dim=1)
    itself_too = torch.ones(T, S, dtype=torch.bool).triu(S - T)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(itself_too, float("-inf"))
    return scores.softmax(-1) @ v


# --------------------------------------------------------------------------- 4.3
class RopeFromZero(MyCachedAttention):
    def forward(self, x, cache=None, start=0):
        q, k, v = self.heads(x)
        cos, sin = self.rope(x.shape[1], 0)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(start, k, v)
        return self.out(my_cached_attention(q, k, v))


class RopeOnValues(MyCachedAttention):
    def forward(self, x, cache=None, start=0):
        q, k, v = self.heads(x)
        cos, sin = self.rope(x.shape[1], start)
        q, k, v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), apply_rope(v, cos, sin)
        if cache is not None:
            k, v = cache.update(start, k, v)
        return self.out(my_cached_attention(q, k, v))


class KeysNotRotated(MyCachedAttention):
    def forward(self, x, cache=None, start=0):
        q, k, v = self.heads(x)
        cos, sin = self.rope(x.shape[1], start)
        q = apply_rope(q, cos, sin)
        if cache is not None:
            k, v = cache.update(start, k, v)
        return self.out(my_cached_attention(q, k, v))


class CacheWrittenNotRead(MyCachedAttention):
    def forward(self, x, cache=None, start=0):
        q, k, v = self.heads(x)
        cos, sin = self.rope(x.shape[1], start)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache.update(start, k, v)
        return self.out(my_cached_attention(q, k, v))


class FixedBase(MyCachedAttention):
    def rope(self, T, start):
        return rope_cos_sin(T, self.head_dim, base=10000.0, offset=start)


class UpdatesAtWrongStart(MyCachedAttention):
    def forward(self, x, cache=None, start=0):
        q, k, v = self.heads(x)
        cos, sin = self.rope(x.shape[1], start)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(start + 1, k, v)
        return self.out(my_cached_attention(q, k, v))


class KeysWithAllHeads(MyCachedAttention):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)


LayerWithRepeatedHeads = _with_globals(MyCachedAttention, my_cached_attention=attention_repeat)


class MaskAsBuffer(MyCachedAttention):
    """nanoGPT's way: a causal mask kept as a persistent buffer named bias."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.register_buffer("bias", torch.ones(64, 64).tril().view(1, 1, 64, 64))


# --------------------------------------------------------------------------- 4.4
def generate_without_caches(model, idx, max_new_tokens):
    out, chosen_by = idx, []
    for _ in range(max_new_tokens):
        logits = model(out)[:, -1]
        chosen_by.append(logits)
        out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
    return out, torch.stack(chosen_by, dim=1)


def generate_whole_sequence_each_step(model, idx, max_new_tokens):
    B, T = idx.shape
    caches = model.new_caches(B, T + max_new_tokens)
    out, chosen_by = idx, []
    for _ in range(max_new_tokens):
        logits = model(out, caches=caches, start=0)[:, -1]
        chosen_by.append(logits)
        out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
    return out, torch.stack(chosen_by, dim=1)


def _generate(
    model, idx, max_new_tokens, *, position=lambda T, i: T + i, max_len=None, after=False, prefill_one_by_one=False
):
    B, T = idx.shape
    caches = model.new_caches(B, max_len or T + max_new_tokens)
    if prefill_one_by_one:
        for t in range(T):
            logits = model(idx[:, t : t + 1], caches=caches, start=t)[:, -1]
    else:
        logits = model(idx, caches=caches, start=0)[:, -1]
    out, chosen_by = [idx], []
    for i in range(max_new_tokens):
        if not after:
            chosen_by.append(logits)
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        if i < max_new_tokens - 1 or after:
            logits = model(nxt, caches=caches, start=position(T, i))[:, -1]
        if after:
            chosen_by.append(logits)
    return torch.cat(out, dim=1), torch.stack(chosen_by, dim=1)


def generate_start_stuck(model, idx, max_new_tokens):
    return _generate(model, idx, max_new_tokens, position=lambda T, i: T)


def generate_start_one_late(model, idx, max_new_tokens):
    return _generate(model, idx, max_new_tokens, position=lambda T, i: T + i + 1)


def generate_caches_too_small(model, idx, max_new_tokens):
    return _generate(model, idx, max_new_tokens, max_len=idx.shape[1])


def generate_logits_after_the_token(model, idx, max_new_tokens):
    return _generate(model, idx, max_new_tokens, after=True)


def generate_prefill_token_by_token(model, idx, max_new_tokens):
    return _generate(model, idx, max_new_tokens, prefill_one_by_one=True)


generate_with_a_late_writing_cache = _with_globals(my_generate, MyKVCache=WritesOneLate)
generate_with_an_unrotating_layer = _with_globals(my_generate, MyCachedAttention=RopeFromZero)


# --------------------------------------------------------------------------- 4.5
def bytes_query_heads(cfg, B, T, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.n_layer * B * T * cfg.n_head * cfg.head_dim * size


def bytes_keys_only(cfg, B, T, dtype):
    return my_cache_bytes(cfg, B, T, dtype) // 2


def bytes_one_layer(cfg, B, T, dtype):
    return my_cache_bytes(cfg, B, T, dtype) // cfg.n_layer


def bytes_as_elements(cfg, B, T, dtype):
    return 2 * cfg.n_layer * B * T * cfg.n_kv_head * cfg.head_dim


def bytes_in_bits(cfg, B, T, dtype):
    return 8 * my_cache_bytes(cfg, B, T, dtype)


def bytes_as_float(cfg, B, T, dtype):
    return float(my_cache_bytes(cfg, B, T, dtype))


bytes_beside_a_growing_cache = _with_globals(my_cache_bytes, MyKVCache=GrowsByConcatenation)


class CacheOfHalfPrecision(MyKVCache):
    def __init__(self, B, H_kv, T_max, D, dtype=torch.float32):
        super().__init__(B, H_kv, T_max, D, torch.float16)


bytes_beside_a_half_precision_cache = _with_globals(my_cache_bytes, MyKVCache=CacheOfHalfPrecision)


WRONG_VERSIONS = {
    "check_kv_cache": [
        (WritesOneLate, "one position too late"),
        (ReturnsWholeBuffer, "never written"),
        (ReturnsOnlyNew, "every position so far"),
        (GrowsByConcatenation, "preallocate"),
        (SwapsKeysAndValues, "swapped"),
        (IgnoresDtype, "dtype given to __init__"),
        (ReturnsCopies, "copies"),
        (PositionsFirst, "positions are dim 2"),
        (AppendsAtItsOwnPointer, "write at `start`, not after the last write"),
    ],
    "check_cached_attention": [
        (attention_repeat, "repeat_interleave"),
        (attention_mask_from_start, "aligned to the end"),
        (attention_no_mask, "causal among themselves"),
        (attention_unscaled, "1/√D"),
        (attention_diagonal_masked, "itself included"),
    ],
    "check_cached_layer": [
        (RopeFromZero, "offset=start"),
        (RopeOnValues, "not v"),
        (KeysNotRotated, "rotate k"),
        (CacheWrittenNotRead, "every key and value so far"),
        (FixedBase, "cfg.rope_base"),
        (UpdatesAtWrongStart, "this call's start"),
        (KeysWithAllHeads, "H_kv"),
        (LayerWithRepeatedHeads, "Step 4.2"),
        (MaskAsBuffer, "persistent=False"),
    ],
    "check_cached_generate": [
        (generate_without_caches, "caches=caches"),
        (generate_whole_sequence_each_step, "only the newest token"),
        (generate_start_stuck, "sits at position"),
        (generate_start_one_late, "a gap"),
        (generate_caches_too_small, "too small"),
        (generate_logits_after_the_token, "chosen from"),
        (generate_prefill_token_by_token, "whole prompt in one call"),
        (generate_with_a_late_writing_cache, "Step 4.1"),
        (generate_with_an_unrotating_layer, "Step 4.3"),
    ],
    "check_cache_bytes": [
        (bytes_query_heads, "n_kv_head"),
        (bytes_keys_only, "times 2"),
        (bytes_one_layer, "cfg.n_layer"),
        (bytes_as_elements, "bytes per element"),
        (bytes_in_bits, "bits"),
        (bytes_as_float, "an int"),
        (bytes_beside_a_growing_cache, "Step 4.1"),
        (bytes_beside_a_half_precision_cache, "Step 4.1"),
    ],
}


# --------------------------------------------------------------------------- beyond the two shapes
def test_the_loop_check_drives_smollm2_and_prints_its_text(capsys):
    report = checks.check_cached_generate(my_generate)
    assert report.passed and report.n_cases == 4, report
    out = capsys.readouterr().out
    assert "SmolLM2" in out and "your attention layers" in out and "Once upon a time" in out


def test_the_learners_parts_assemble_into_a_decoder_that_matches_lib():
    """The tiny Llama rebuilt from the solutions' cache and attention layer gives lib's logits."""
    from lib.course.exercises.build03 import TINY, tiny_llama

    model = tiny_llama(TINY, 0)
    layers = []
    for block in model.model.layers:
        layer = MyCachedAttention(TINY)
        layer.load_state_dict(block.self_attn.state_dict())
        layers.append(layer)
    mine = checks.LearnersLlama(model, layers, MyKVCache)
    idx = torch.randint(64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(mine(idx), model(idx), atol=1e-5, rtol=1e-5)
    assert mine.cache_bytes(2, 7) == model.cache_bytes(2, 7)


def test_the_bytes_formula_is_lesson_04s():
    cfg = LlamaConfig.smollm2_135m()
    assert my_cache_bytes(cfg, 1, 1, torch.float32) == kv_cache_bytes(30, 1, 1, 3, 64, 4) == 46_080


def test_a_layer_built_on_an_unwritten_step_4_2_says_so():
    def unwritten(q, k, v):
        raise NotImplementedError

    layer = _with_globals(MyCachedAttention, my_cached_attention=unwritten)
    report = checks.check_cached_layer(layer)
    assert report.problem == "not attempted yet", report
    assert "unwritten, from an earlier step" in report.hint, report


def test_the_loop_check_runs_smollm2_on_the_learners_own_layers(capsys):
    widths = []

    class Recording(MyCachedAttention):
        def __init__(self, cfg):
            widths.append(cfg.n_embd)
            super().__init__(cfg)

    report = checks.check_cached_generate(_with_globals(my_generate, MyCachedAttention=Recording))
    assert report.passed, report
    assert widths.count(576) == 30  # one of the learner's layers in each of SmolLM2's 30 layers
