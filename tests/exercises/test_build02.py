"""Build track 02 (a BERT layer): each check passes a correct solution, refuses the stub, and names
the mistake in at least three plausible wrong versions; a later step names the earlier step whose
function it uses and which is wrong; step 2.5 really compares with transformers' BertModel."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import lib.course.exercises.build02 as checks
from lib.attention import safe_softmax


# ---------------------------------------------------------------- solutions, as a student would
def my_split_heads(x, H):
    B, T, C = x.shape
    return x.view(B, T, H, C // H).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)


class MySelfAttention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = (my_split_heads(proj(x), self.num_heads) for proj in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // self.num_heads) + mask
        y = torch.softmax(scores, dim=-1) @ v  # (B, H, T, D)
        return y.transpose(1, 2).reshape(B, T, C)


def my_post_ln(x, sublayer, norm):
    return norm(x + sublayer(x))


def my_feed_forward(x, dense_in, dense_out, norm):
    return my_post_ln(x, lambda h: dense_out(F.gelu(dense_in(h))), norm)


class MyBertLayer(nn.Module):
    def __init__(self, hidden_size, num_heads, intermediate_size, eps):
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = MySelfAttention(hidden_size, num_heads)
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(hidden_size, hidden_size)
        self.attention.output.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(hidden_size, intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(intermediate_size, hidden_size)
        self.output.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x, mask):
        att = self.attention
        x = my_post_ln(x, lambda h: att.output.dense(att.self(h, mask)), att.output.LayerNorm)
        return my_feed_forward(x, self.intermediate.dense, self.output.dense, self.output.LayerNorm)


SOLUTIONS = {
    "check_split_heads": my_split_heads,
    "check_self_attention": MySelfAttention,
    "check_post_ln": my_post_ln,
    "check_feed_forward": my_feed_forward,
    "check_bert_layer": MyBertLayer,
}


# ---------------------------------------------------------------- wrong versions
def _attention(x, mask, proj, H, split="right", merge="right", scale=True, mask_on="keys", dim=-1, softmax=None):
    B, T, C = x.shape
    D = C // H

    def heads(t):
        if split == "view":
            return t.view(B, H, T, D)
        return t.view(B, T, H, D).transpose(1, 2)

    q, k, v = (heads(p(x)) for p in proj)
    scores = q @ k.transpose(-2, -1) / (math.sqrt(D) if scale else 1.0)
    if mask_on == "keys":
        scores = scores + mask
    elif mask_on == "queries":
        scores = scores + mask.transpose(-2, -1)
    y = (softmax or safe_softmax)(scores, dim=dim) @ v
    return y.reshape(B, T, C) if merge == "no transpose" else y.transpose(1, 2).reshape(B, T, C)


def _attention_class(names=("query", "key", "value"), **mistakes):
    class WrongSelfAttention(nn.Module):
        def __init__(self, hidden_size, num_heads):
            super().__init__()
            self.num_heads = num_heads
            for name in names:
                setattr(self, name, nn.Linear(hidden_size, hidden_size))

        def forward(self, x, mask):
            proj = [getattr(self, name) for name in names]
            return _attention(x, mask, proj, self.num_heads, **mistakes)

    return WrongSelfAttention


def _layer_class(
    norm="post", act=F.gelu, eps_from_caller=True, attention_residual=True, attn_name="attention", **attention_mistakes
):
    class WrongBertLayer(nn.Module):
        def __init__(self, hidden_size, num_heads, intermediate_size, eps):
            super().__init__()
            eps = eps if eps_from_caller else 1e-5
            attention = nn.Module()
            attention.self = _attention_class(**attention_mistakes)(hidden_size, num_heads)
            attention.output = nn.Module()
            attention.output.dense = nn.Linear(hidden_size, hidden_size)
            attention.output.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)
            setattr(self, attn_name, attention)
            self.intermediate = nn.Module()
            self.intermediate.dense = nn.Linear(hidden_size, intermediate_size)
            self.output = nn.Module()
            self.output.dense = nn.Linear(intermediate_size, hidden_size)
            self.output.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

        def forward(self, x, mask):
            att = getattr(self, attn_name)
            ffn = lambda h: self.output.dense(act(self.intermediate.dense(h)))  # noqa: E731
            if norm == "pre":
                x = x + att.output.dense(att.self(att.output.LayerNorm(x), mask))
                return x + ffn(self.output.LayerNorm(x))
            a = att.output.dense(att.self(x, mask))
            x = att.output.LayerNorm(x + a if attention_residual else a)
            return self.output.LayerNorm(x + ffn(x))

    return WrongBertLayer


WRONG_VERSIONS = {
    "check_split_heads": [
        (lambda x, H: x.view(x.shape[0], H, x.shape[1], x.shape[2] // H), "view(B, H, T, D) cuts the memory"),
        (lambda x, H: x.view(*x.shape[:2], H, x.shape[2] // H), "now swap T and H"),
        (lambda x, H: x.view(*x.shape[:2], x.shape[2] // H, H).permute(0, 3, 1, 2), "dealt to the heads in turn"),
        (lambda x, H: x.view(*x.shape[:2], H, x.shape[2] // H).permute(0, 2, 3, 1), "(B, H, D, T)"),
    ],
    "check_self_attention": [
        (_attention_class(split="view"), "view(B, H, T, D)"),
        (_attention_class(merge="no transpose"), "merged without transposing back"),
        (_attention_class(scale=False), "not scaled"),
        (_attention_class(mask_on=None), "padding mask was not applied"),
        (_attention_class(mask_on="queries"), "blocked queries (rows)"),
        (_attention_class(mask_on="queries", softmax=torch.softmax), "did a whole row of scores get -inf?"),
        (_attention_class(dim=-2), "ran over the queries"),
        (_attention_class(names=("q", "k", "v")), "parameter names"),
    ],
    "check_post_ln": [
        (lambda x, sub, norm: x + sub(norm(x)), "Pre-LN"),
        (lambda x, sub, norm: norm(sub(x)), "residual is missing"),
        (lambda x, sub, norm: x + norm(sub(x)), "only the sublayer's output"),
        (lambda x, sub, norm: norm(x) + sub(x), "not x alone"),
        (lambda x, sub, norm: F.layer_norm(x + sub(x), x.shape[-1:]), "use the norm you are given"),
    ],
    "check_feed_forward": [
        (lambda x, a, b, norm: norm(x + b(F.gelu(a(x), approximate="tanh"))), "tanh approximation"),
        (lambda x, a, b, norm: norm(x + b(F.relu(a(x)))), "ReLU"),
        (lambda x, a, b, norm: norm(b(F.gelu(a(x)))), "residual is missing"),
        (lambda x, a, b, norm: x + b(F.gelu(a(norm(x)))), "Pre-LN"),
        (lambda x, a, b, norm: norm(x + F.gelu(b(F.gelu(a(x))))), "GELU comes once"),
    ],
    "check_bert_layer": [
        (_layer_class(norm="pre"), "Pre-LN"),
        (_layer_class(act=lambda h: F.gelu(h, approximate="tanh")), "tanh GELU"),
        (_layer_class(attn_name="attn"), "parameter names"),
        (_layer_class(mask_on=None), "padding mask was not applied"),
        (_layer_class(eps_from_caller=False), "eps"),
        (_layer_class(attention_residual=False), "attention sublayer's residual is missing"),
        (_layer_class(split="view"), "view(B, H, T, D)"),
    ],
}


# ---------------------------------------------------------------- later steps name the earlier one
def _notebook(source: str, **names) -> dict:
    """A notebook's namespace: `source` run with `names` already defined (earlier cells)."""
    namespace = dict(names, __name__="__main__", torch=torch, nn=nn, F=F, math=math)
    exec(source, namespace)
    return namespace


def test_the_feed_forward_check_names_step_2_3_when_my_post_ln_is_wrong():
    nb = _notebook(
        "def my_feed_forward(x, dense_in, dense_out, norm):\n"
        "    return my_post_ln(x, lambda h: dense_out(F.gelu(dense_in(h))), norm)\n",
        my_post_ln=lambda x, sub, norm: x + sub(norm(x)),
    )
    report = checks.check_feed_forward(nb["my_feed_forward"])
    assert not report.passed and "Pre-LN" in report.hint and "Step 2.3" in report.hint, report


def test_the_layer_check_names_the_step_of_a_wrong_part():
    source = (
        "class MyBertLayer(nn.Module):\n"
        "    def __init__(self, hidden_size, num_heads, intermediate_size, eps):\n"
        "        super().__init__()\n"
        "        self.inner = Base(hidden_size, num_heads, intermediate_size, eps)\n"
        "    def forward(self, x, mask):\n"
        "        att, inner = self.inner.attention, self.inner\n"
        "        x = my_post_ln(x, lambda h: att.output.dense(att.self(h, mask)),\n"
        "                       att.output.LayerNorm)\n"
        "        return my_feed_forward(x, inner.intermediate.dense, inner.output.dense,\n"
        "                               inner.output.LayerNorm)\n"
        "    def state_dict(self, *a, **k):\n"
        "        return self.inner.state_dict(*a, **k)\n"
        "    def load_state_dict(self, *a, **k):\n"
        "        return self.inner.load_state_dict(*a, **k)\n"
    )
    relu_ffn = lambda x, a, b, norm: norm(x + b(F.relu(a(x))))  # noqa: E731
    nb = _notebook(source, Base=MyBertLayer, my_post_ln=my_post_ln, my_feed_forward=relu_ffn)
    report = checks.check_bert_layer(nb["MyBertLayer"])
    assert not report.passed and "ReLU" in report.hint and "Step 2.4" in report.hint, report


def test_a_layer_built_on_a_wrong_self_attention_names_step_2_2():
    source = (
        "class MyBertLayer(Base):\n"
        "    def __init__(self, hidden_size, num_heads, intermediate_size, eps):\n"
        "        super().__init__(hidden_size, num_heads, intermediate_size, eps)\n"
        "        self.attention.self = MySelfAttention(hidden_size, num_heads)\n"
    )
    nb = _notebook(source, Base=MyBertLayer, MySelfAttention=_attention_class(scale=False))
    report = checks.check_bert_layer(nb["MyBertLayer"])
    assert not report.passed and "not scaled" in report.hint and "Step 2.2" in report.hint, report


def test_a_layer_written_on_an_unwritten_self_attention_names_step_2_2():
    class Unwritten(nn.Module):  # Step 2.2's stub
        def __init__(self, *args):
            super().__init__()
            raise NotImplementedError

    source = (
        "class MyBertLayer(nn.Module):\n"
        "    def __init__(self, hidden_size, num_heads, intermediate_size, eps):\n"
        "        super().__init__()\n"
        "        self.attention = nn.Module()\n"
        "        self.attention.self = MySelfAttention(hidden_size, num_heads)\n"
        "    def forward(self, x, mask):\n"
        "        return self.attention.self(x, mask)\n"
    )
    nb = _notebook(source, MySelfAttention=Unwritten)
    report = checks.check_bert_layer(nb["MyBertLayer"])
    assert report.problem == "not attempted yet" and "Step 2.2" in report.hint, report


# ---------------------------------------------------------------- the real model
def test_step_2_5_expects_transformers_hidden_states_that_lib_reproduces_within_its_tolerance():
    hf, data = checks._minilm_transformers(), checks._minilm()
    assert len(hf["layers"]) == 6 and len(hf["hidden"]) == 7
    assert bool((data["enc"]["attention_mask"] == 0).any()), "the batch must hold padding"
    lib_layers = data["bert"].encoder.layer
    for i, state in hf["layers"].items():
        assert set(state) == set(lib_layers[i].state_dict())  # Hugging Face's names, as lib's
        with torch.no_grad():
            ours = lib_layers[i](hf["hidden"][i], data["mask"])[0]
        assert torch.allclose(ours, hf["hidden"][i + 1], **checks._TOL)


def test_step_2_5_fails_an_answer_off_by_little_more_than_rounding():
    class SlightlyOff(MyBertLayer):  # right on made-up sizes, off by ~1e-4 at MiniLM's
        def forward(self, x, mask):
            return super().forward(x, mask) * (1 + 1e-5 * (x.shape[-1] == 384))

    report = checks.check_bert_layer(SlightlyOff)
    assert not report.passed and "all-MiniLM-L6-v2" in report.failed_case, report


def test_a_constructor_that_raises_is_reported_not_raised():
    class Broken(nn.Module):
        def __init__(self, *args):
            super().__init__()
            raise ValueError("oops")

    for check in (checks.check_self_attention, checks.check_bert_layer):
        report = check(Broken)
        assert not report.passed and "ValueError" in report.problem


def test_the_notebook_shows_the_batch_the_checks_use():
    from exercise_helpers import ROOT

    track = (ROOT / "lessons" / "build" / "02-build-bert-layer.md").read_text()
    assert all(f'"{sentence}"' in track for sentence in checks.SENTENCES)
