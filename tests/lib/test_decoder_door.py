"""The door of a decoder's forward (lib._door.DECODER_FORWARD), which GPT, the models built on it,
Llama and MambaLM share: one refusal table, (argument, bad value, error, the whole message), run on
each; a row's last entry, where there is one, says what MambaLM answers instead (None: it accepts,
having no context limit)."""

import pytest
import torch
from refusals import assert_refuses, rows

from lib.gpt import GPT, GPTConfig
from lib.llama import Llama, LlamaConfig
from lib.mamba import MambaConfig
from lib.mamba_lm import MambaLM

MODELS = {
    "gpt": lambda: GPT(GPTConfig.tiny(block_size=16)),
    "llama": lambda: Llama(LlamaConfig.tiny(block_size=16)),
    "mamba": lambda: MambaLM(MambaConfig.tiny(n_layers=2, d_model=32)),
}
_NO_PADDING = (
    "a model with Mamba layers takes no padding: attention_mask must be None or all ones (a padding token "
    "would enter the recurrent state); run rows separately"
)
idx = torch.zeros(2, 5, dtype=torch.long)
_RANGE = "must lie in [0, vocab_size=64)"
_MASK_VALUES = "attention_mask must hold only 1 (token) and 0 (padding), as an integer or bool tensor"
# fmt: off
FORWARD_REFUSALS = [
    ("idx", idx[0], ValueError, "idx must have shape (B, T) (2 dims), got (5,)"),
    ("idx", idx.float(), TypeError, "idx must be an int64 (or int32) tensor, got torch.float32"),
    ("idx", [[1]], TypeError, "idx must be a torch.Tensor, got list"),
    ("idx", idx[:, :0], ValueError, "idx must have shape (B, T) with every size >= 1, got (2, 0)"),
    ("idx", torch.full((2, 5), 64), ValueError, f"idx {_RANGE}, got min 64, max 64"),
    ("idx", torch.full((2, 5), -1), ValueError, f"idx {_RANGE}, got min -1, max -1"),
    ("idx", torch.zeros(1, 17, dtype=torch.long), ValueError,
     "idx has T=17 tokens from position 0, past the context block_size=16", None),
    ("idx", idx.to("meta"), ValueError, "idx must be on the model's device cpu, got meta"),
    ("start", -1, ValueError, "start must be >= 0, got -1"),
    ("start", 1.0, TypeError, "start must be an int, got float"),
    ("start", 2, ValueError,
     "start > 0 needs caches: without them the earlier positions are not there to attend to, got start=2"),
    ("targets", idx.float(), TypeError, "targets must be an int64 (or int32) tensor, got torch.float32"),
    ("targets", idx[:, :4], ValueError, "targets must have shape (B, T) with T = 5 as in idx, got (2, 4)"),
    ("targets", torch.full((2, 5), 64), ValueError, f"targets {_RANGE} (or be -100 to skip a position)"),
    ("caches", "3 rows", ValueError, "caches were built for batch size 3, idx has batch size 2"),
    ("caches", "1 layer", ValueError, "caches must hold one cache per layer ({n_layer}), got 1"),
    ("attention_mask", torch.ones(2, 4, dtype=torch.long), ValueError,
     "attention_mask must have shape (B, start + T) = (2, 5), covering cached positions too, got (2, 4)"),
    (
        "attention_mask",
        torch.tensor([[1, 1, 0, 0, 0], [1] * 5]),
        ValueError,
        "attention_mask must be left-padded: in each row every 0 comes before every 1 (right padding would put "
        "new tokens after the padding)",
        _NO_PADDING,
    ),
    ("attention_mask", torch.full((2, 5), 2), ValueError, _MASK_VALUES, _NO_PADDING),
    ("attention_mask", torch.ones(2, 5), ValueError, _MASK_VALUES),
    ("attention_mask", torch.tensor([[0] * 5, [1] * 5]), ValueError,
     "attention_mask: every row needs at least one real token, at the last position", _NO_PADDING),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message, mamba", rows([(*r, r[3])[:5] for r in FORWARD_REFUSALS]))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_refusals(name, argument, bad, error, message, mamba):
    model = MODELS[name]()
    if isinstance(bad, str):  # caches, made by this model
        bad = model.new_caches(3, 8) if bad == "3 rows" else model.new_caches(2, 8)[:1]
    if name == "mamba" and mamba is None:
        model(**{"idx": idx, argument: bad})  # no context limit
        return
    message = (mamba if name == "mamba" else message).format(n_layer=model.config.n_layer)
    assert_refuses(model, dict(idx=idx), argument, bad, error, message)


def test_what_the_door_lets_through():
    # -100 in the targets skips a position; a left-padded mask with a real last token passes
    for name, make in MODELS.items():
        model = make()
        _, loss = model(idx, torch.full((2, 5), -100).index_fill(1, torch.tensor([0]), 3))
        assert torch.isfinite(loss)
        mask = torch.tensor([[0, 0, 1, 1, 1], [1] * 5]) if name != "mamba" else torch.ones(2, 5, dtype=torch.long)
        assert model(idx, attention_mask=mask).shape == (2, 5, model.config.vocab_size)
