"""bertviz views rewritten to work offline: no CDN left, deterministic, the data are lib's."""

import json
import re

import pytest
import torch

from widgets.bertviz_offline import DIGITS, head_view, make_offline, model_view


def attentions(L=2, H=3, T=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, T, T, generator=g).softmax(-1) for _ in range(L)]


TOKENS = ["[CLS]", "hello", "world", "[SEP]"]


@pytest.mark.parametrize("view", [head_view, model_view])
def test_view_is_self_contained_and_deterministic(view):
    a = view(attentions(), TOKENS)
    b = view(attentions(), TOKENS)
    assert a.html == b.html, "stored outputs must not change between runs"
    assert "cdnjs" not in a.html and "requirejs(" not in a.html and "require.config" not in a.html
    assert "d3 v5.7.0" in a.html and "jQuery 3.7.1" in a.html
    assert a._repr_html_() == a.html and "offline" in repr(a)


def test_view_carries_the_attention_weights_rounded():
    atts = attentions()
    html = head_view(atts, TOKENS).html
    params = json.loads(re.search(r"const params = (\{.*?\});", html, re.S).group(1))
    drawn = torch.tensor(params["attention"][0]["attn"], dtype=torch.float64)  # (L, H, T, T), batch item 0
    expected = torch.stack([a[0] for a in atts]).double()
    assert torch.allclose(drawn, expected, atol=0.5 * 10**-DIGITS)
    assert params["attention"][0]["left_text"] == TOKENS


def test_different_data_give_different_element_ids():
    ids = {re.search(r"bertviz-[0-9a-f]{32}", head_view(attentions(seed=s), TOKENS).html).group(0) for s in (0, 1)}
    assert len(ids) == 2


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="tokens"):
        head_view(attentions(), TOKENS[:3])
    with pytest.raises(ValueError, match=r"\(B, H, T, T\)"):
        model_view([torch.rand(2, 3)], TOKENS)
    with pytest.raises(TypeError, match="attentions"):
        head_view([], TOKENS)
    with pytest.raises(ValueError, match="unexpected bertviz HTML"):
        make_offline("<div>not bertviz</div>")
