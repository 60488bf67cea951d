"""bertviz head and model views draw in Chromium with the network switched off."""

import torch

from widgets.bertviz_offline import head_view, model_view

TOKENS = ["[CLS]", "the", "cat", "sat", "[SEP]"]


def test_views_render_with_no_network(browser, tmp_path):
    g = torch.Generator().manual_seed(0)
    atts = [torch.randn(1, 2, 5, 5, generator=g).softmax(-1) for _ in range(2)]
    page_html = tmp_path / "views.html"
    page_html.write_text(f"<html><body>{head_view(atts, TOKENS).html}<hr>{model_view(atts, TOKENS).html}</body></html>")
    context = browser.new_context(offline=True)
    page = context.new_page()
    errors, remote = [], []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("request", lambda r: not r.url.startswith("file:") and remote.append(r.url))
    page.goto(page_html.as_uri())
    page.wait_for_function("() => document.querySelectorAll('svg text').length >= 10", timeout=15_000)
    drawn = page.evaluate("() => Array.from(document.querySelectorAll('svg text')).map(t => t.textContent)")
    assert all(tok in drawn for tok in TOKENS)  # the head view labels every token
    assert page.locator("svg").count() >= 2  # head view and model view
    assert errors == [] and remote == []
    context.close()
