"""lib.course.training_cache: a replayed run is the real run, bit for bit, and a run that differs in
anything the result depends on is never replayed."""

import copy

import pytest
import tiny_models
import torch

import lib.moe_lm
import lib.train
from lib.course.precision import default_dtype
from lib.course.training_cache import ENV_DIR, ENV_MODE, Unfingerprintable, cache_dir, run_key
from lib.gpt import GPT, GPTConfig
from lib.moe_lm import moe_gpt, router_logits_of, train_moe_lm
from lib.tasks import SelectiveCopying, train_on_task
from lib.train import train_lm

DATA = torch.arange(400) % 23  # a 1-D token stream, vocab 23
KW = dict(steps=6, batch_size=4, seq_len=16, lr=3e-3, seed=0)


def tiny_gpt(**changes) -> GPT:
    return tiny_models.gpt(vocab_size=23, n_layer=1, n_embd=16, n_head=2, block_size=16, **changes).train()


def entries(root):
    return sorted(p for p in root.rglob("*.pt"))


def same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k  # bitwise: a replay is not an approximation
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
    assert [m.training for m in a.modules()] == [m.training for m in b.modules()]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.delenv(ENV_MODE, raising=False)
    return tmp_path


def forbid_training(monkeypatch, module=lib.train, name="get_batch"):
    """Make any real training step fail: what runs afterwards must be a replay."""

    def boom(*a, **k):
        raise AssertionError("trained for real where a replay was expected")

    monkeypatch.setattr(module, name, boom)


def test_off_by_default_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_DIR, raising=False)
    assert cache_dir() is None
    model = tiny_gpt()
    train_lm(model, DATA, **KW)
    assert entries(tmp_path) == []


def test_replay_gives_back_the_trained_model_bit_for_bit(cache, monkeypatch):
    real, first, again = tiny_gpt(), tiny_gpt(), tiny_gpt()
    torch.manual_seed(5)
    monkeypatch.delenv(ENV_DIR)
    real_losses = train_lm(real, DATA, **KW)
    real_rng = torch.random.get_rng_state()

    monkeypatch.setenv(ENV_DIR, str(cache))
    torch.manual_seed(5)
    calls = []
    assert train_lm(first, DATA, **KW, on_step=lambda s, l: calls.append((s, l))) == real_losses  # a miss: recorded
    assert len(entries(cache)) == 1
    same_model(first, real)

    forbid_training(monkeypatch)
    torch.manual_seed(5)
    replayed = []
    assert train_lm(again, DATA, **KW, on_step=lambda s, l: replayed.append((s, l))) == real_losses
    same_model(again, real)
    assert replayed == calls == list(enumerate(real_losses))  # the loss curve is drawn again
    assert torch.equal(torch.random.get_rng_state(), real_rng)
    assert not again.training  # train_lm leaves the model in eval mode; so does its replay


def test_a_run_that_differs_in_anything_has_another_key():
    base = tiny_gpt()
    args = dict(model=base, data=DATA, **KW, warmup=None, weight_decay=0.1)
    key = run_key(train_lm, args)
    assert run_key(train_lm, dict(args)) == key  # deterministic

    nudged = copy.deepcopy(base)
    with torch.no_grad():
        w = nudged.transformer.wte.weight
        w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(1.0))  # one bit of one weight
    data = DATA.clone()
    data[399] = 0
    frozen = copy.deepcopy(base)
    next(frozen.parameters()).requires_grad_(False)
    untied = copy.deepcopy(base)
    untied.lm_head.weight = torch.nn.Parameter(untied.transformer.wte.weight.detach().clone())  # same values, untied
    variants = {
        "one bit of one weight": dict(args, model=nudged),
        "the mask switched off (same weights)": dict(args, model=tiny_gpt(causal=False)),
        "untied head (same values)": dict(args, model=untied),
        "one parameter frozen": dict(args, model=frozen),
        "one token of the data": dict(args, data=data),
        "learning rate": dict(args, lr=3.0001e-3),
        "steps": dict(args, steps=7),
    }
    keys = {name: run_key(train_lm, a) for name, a in variants.items()}
    for name, k in keys.items():
        assert k != key, name
    assert run_key(train_on_task, args) != key  # another function

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)  # another split of each parallel sum
        assert run_key(train_lm, args) != key
    finally:
        torch.set_num_threads(threads)
    torch.manual_seed(1)
    k1 = run_key(train_lm, args)
    torch.manual_seed(2)
    assert run_key(train_lm, args) != k1  # the global random state (dropout would draw from it)
    torch.manual_seed(2)
    k2 = run_key(train_lm, args)
    with default_dtype(torch.float64):  # the default dtype decides what the run creates
        torch.manual_seed(2)
        assert run_key(train_lm, args) != k2


@pytest.mark.parametrize(
    "variable, value", [("ATEN_CPU_CAPABILITY", "default"), ("ONEMASK_CPU_KERNEL", "0"), ("CC", "clang")]
)
def test_a_run_under_other_numerics_or_another_scan_kernel_has_another_key(variable, value, monkeypatch):
    args = dict(model=tiny_gpt(), data=DATA, **KW)
    monkeypatch.delenv(variable, raising=False)
    key = run_key(train_lm, args)
    monkeypatch.setenv(variable, value)
    assert run_key(train_lm, args) != key


def test_a_class_defined_in_a_notebook_is_keyed_by_its_code():
    """Two classes with the same name and the same weights but another forward must not share a run."""

    def make(body):
        ns = {"torch": torch, "__name__": "__main__"}
        exec(
            "class Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.lin = torch.nn.Linear(4, 4)\n    def forward(self, x):\n        return " + body,
            ns,
        )
        torch.manual_seed(0)
        return ns["Net"]()

    a, b, a2 = make("self.lin(x)"), make("self.lin(x).relu()"), make("self.lin(x)")
    key = lambda m: run_key(train_lm, dict(model=m, data=DATA))
    assert key(a) == key(a2) and key(a) != key(b)


def test_a_missed_run_trains_for_real_and_record_mode_never_replays(cache, monkeypatch):
    first = tiny_gpt()
    train_lm(first, DATA, **KW)
    calls = []
    real_get_batch = lib.train.get_batch
    monkeypatch.setattr(lib.train, "get_batch", lambda *a, **k: calls.append(1) or real_get_batch(*a, **k))
    train_lm(tiny_gpt(), DATA, **dict(KW, lr=1e-3))  # another learning rate: a miss
    assert len(calls) == KW["steps"] and len(entries(cache)) == 2

    monkeypatch.setenv(ENV_MODE, "record")
    calls.clear()
    again = tiny_gpt()
    train_lm(again, DATA, **KW)  # recorded before, but this mode trains every time
    assert len(calls) == KW["steps"]
    same_model(again, first)

    monkeypatch.setenv(ENV_MODE, "always")
    with pytest.raises(ValueError, match=f"{ENV_MODE} must be one of replay, record"):
        train_lm(tiny_gpt(), DATA, **KW)


def test_an_unreadable_entry_is_trained_again_and_rewritten(cache, monkeypatch):
    real = tiny_gpt()
    train_lm(real, DATA, **KW)
    (path,) = entries(cache)
    path.write_bytes(b"not a pickle")
    again = tiny_gpt()
    train_lm(again, DATA, **KW)
    same_model(again, real)
    forbid_training(monkeypatch)
    third = tiny_gpt()
    train_lm(third, DATA, **KW)  # the rewritten entry replays
    same_model(third, real)


def test_a_run_without_a_recorded_curve_trains_again_for_a_callback(cache, monkeypatch):
    train_lm(tiny_gpt(), DATA, **KW)  # no on_step: the entry has no step log
    calls = []
    train_lm(tiny_gpt(), DATA, **KW, on_step=lambda s, l: calls.append(s))
    assert calls == list(range(KW["steps"]))
    forbid_training(monkeypatch)
    replayed = []
    train_lm(tiny_gpt(), DATA, **KW, on_step=lambda s, l: replayed.append(s))
    assert replayed == calls


def test_hooks_and_unhashable_inputs_are_not_cached(cache):
    hooked = tiny_gpt()
    hooked.transformer.h[0].register_forward_hook(lambda *a: None)
    with pytest.raises(Unfingerprintable, match="hook"):
        run_key(train_lm, dict(model=hooked, data=DATA))
    train_lm(hooked, DATA, **KW)  # trains, uncached
    assert entries(cache) == []
    with pytest.raises(Unfingerprintable, match="cannot fingerprint"):
        run_key(train_lm, dict(model=tiny_gpt(), data=DATA, extra=_Slotted()))


class _Slotted:
    __slots__ = ("x",)


def test_replay_restores_what_the_run_left_on_modules(cache, monkeypatch):
    """An MoE layer keeps its last router logits: after a replay they are the real run's."""

    def model():
        torch.manual_seed(0)
        return moe_gpt(GPTConfig(vocab_size=23, block_size=16, n_layer=1, n_head=2, n_embd=16), 4, 2, 32)

    real = model()
    train_lm(real, DATA, **KW)
    forbid_training(monkeypatch)
    again = model()
    assert router_logits_of(again) == []
    train_lm(again, DATA, **KW)
    same_model(again, real)
    for a, b in zip(router_logits_of(again), router_logits_of(real), strict=True):
        assert torch.equal(a, b)


def test_train_on_task_and_train_moe_lm_replay(cache, monkeypatch):
    task = SelectiveCopying(n_data=2, n_blank=3, n_symbols=4)

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig.tiny(vocab_size=task.vocab_size, n_layer=1, n_embd=16, n_head=2, block_size=task.seq_len))

    real = model()
    losses = train_on_task(real, task, steps=4, batch_size=8)
    moe = train_moe_lm(0.1, steps=3, n_layer=1, n_embd=16, d_ff=32, num_experts=4, seq_len=16)
    rng = torch.random.get_rng_state()  # train_moe_lm seeds the global generator itself

    forbid_training(monkeypatch)
    forbid_training(monkeypatch, lib.moe_lm)  # train_moe_lm draws its batches with its own import of get_batch
    monkeypatch.setattr(SelectiveCopying, "__call__", lambda *a: (_ for _ in ()).throw(AssertionError("trained")))
    again = model()
    assert train_on_task(again, task, steps=4, batch_size=8) == losses
    same_model(again, real)
    torch.manual_seed(123)  # another state than the recorded run's: train_moe_lm seeds the generator itself
    replayed = train_moe_lm(0.1, steps=3, n_layer=1, n_embd=16, d_ff=32, num_experts=4, seq_len=16)
    assert replayed.loss == moe.loss and torch.equal(replayed.load, moe.load)
    same_model(replayed.model, moe.model)
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_a_callback_given_more_than_a_loss_is_not_replayed(cache, monkeypatch):
    seen = []
    train_moe_lm(
        0.1,
        steps=2,
        n_layer=1,
        n_embd=16,
        d_ff=32,
        num_experts=4,
        seq_len=16,
        on_step=lambda step, record: seen.append(len(record.loss)),
    )
    assert seen == [1, 2] and entries(cache) == []  # its record grows step by step: nothing to replay


def test_a_change_to_lib_source_is_a_new_key(tmp_path, monkeypatch):
    import lib.course.training_cache as tc

    (tmp_path / "gpt.py").write_text("x = 1\n")
    monkeypatch.setattr(tc, "_LIB", tmp_path)
    tc._lib_digest.cache_clear()
    try:
        args = dict(model=tiny_gpt(), data=DATA)
        before = run_key(train_lm, args)
        (tmp_path / "gpt.py").write_text("x = 2\n")  # an edit to lib, however small
        tc._lib_digest.cache_clear()
        assert run_key(train_lm, args) != before
    finally:
        tc._lib_digest.cache_clear()  # computed again, from the real lib, once monkeypatch undoes _LIB
