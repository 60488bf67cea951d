"""MLM corruption view: which tokens BERT's rule selected, and what each one became.

Three rows over the WordPiece tokens of a sentence: the original tokens, the model's input after
corruption, and the label the loss sees (the original token where selected, −100 elsewhere).
Colour and the cell text both say each token's fate (never colour alone): kept (not selected),
→ [MASK], → a random token, or selected but left unchanged.

`mlm_view_figure(...)` is the static face (a slider steps through random draws, no kernel
needed); `MLMView(...)` the live one (sentence, probability and seed controls). The corruption is
`lib.bert.mlm_corrupt`, the tokenizer all-MiniLM-L6-v2's; this module only draws.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import plotly.graph_objects as go
import torch

from lib.bert import minilm_tokenizer, mlm_corrupt
from widgets._base import LiveView
from widgets._render import OKABE_ITO

__all__ = ["FATES", "MLMState", "MLMView", "corruption_table", "mlm_view_figure"]

FATES = ("not selected", "selected → [MASK]", "selected → random token", "selected, unchanged")
FATE_COLOURS = ["#eeeeee", OKABE_ITO[0], OKABE_ITO[1], OKABE_ITO[2]]
ROWS = ("original", "model input", "label")
MAX_TOKENS = 40


@dataclass(frozen=True)
class MLMState:
    sentence: str = "The quick brown fox jumps over the lazy dog because it wants to reach the river bank."
    prob: float = 0.15
    seed: int = 0


def corruption_table(state: MLMState) -> dict:
    """Tokens, corrupted tokens, labels and each position's fate (an index into FATES)."""
    tok = minilm_tokenizer()
    ids = tok(state.sentence or " ", truncation=True, max_length=MAX_TOKENS, return_tensors="pt")["input_ids"]  # (1, T)
    g = torch.Generator().manual_seed(state.seed)
    corrupted, labels = mlm_corrupt(
        ids,
        mask_token_id=tok.mask_token_id,
        vocab_size=tok.vocab_size,
        special_token_ids=tok.all_special_ids,
        prob=state.prob,
        generator=g,
    )
    ids, corrupted, labels = ids[0], corrupted[0], labels[0]
    selected = labels != -100
    fate = torch.zeros_like(ids)
    fate[selected & (corrupted == tok.mask_token_id)] = 1
    fate[selected & (corrupted != tok.mask_token_id) & (corrupted != ids)] = 2
    fate[selected & (corrupted == ids)] = 3
    return {
        "original": tok.convert_ids_to_tokens(ids),
        "input": tok.convert_ids_to_tokens(corrupted),
        "labels": [tok.convert_ids_to_tokens(int(i)) if i != -100 else "−100" for i in labels],
        "fate": fate.tolist(),
        "ids": ids,
        "corrupted": corrupted,
        "label_ids": labels,
    }


def _trace_data(table: dict) -> dict:
    fates = table["fate"]
    z = [fates, fates, fates]  # (3 rows, T)
    text = [table["original"], table["input"], table["labels"]]
    hover = [[f"{row}: {t}<br>{FATES[f]}" for t, f in zip(texts, fates)] for row, texts in zip(ROWS, text)]
    return {"z": z, "text": text, "customdata": hover}


def _colorscale() -> list:
    n = len(FATE_COLOURS)
    scale = []
    for i, c in enumerate(FATE_COLOURS):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


def _summary(table: dict, state: MLMState) -> str:
    counts = [table["fate"].count(i) for i in range(len(FATES))]
    return (
        f"p = {state.prob:.2f}, seed {state.seed}: {sum(counts[1:])} of {len(table['fate'])} tokens selected "
        f"({counts[1]} → [MASK], {counts[2]} → random, {counts[3]} unchanged)"
    )


def mlm_view_figure(state: MLMState | None = None, *, seeds: int = 0, **changes) -> go.Figure:
    """The three-row view for `state`; `seeds=n` adds a slider over draws seed..seed+n-1."""
    state = replace(state or MLMState(), **changes)
    if not 0.0 <= state.prob <= 1.0:
        raise ValueError(f"prob must be in [0, 1], got {state.prob}")
    table = corruption_table(state)
    d = _trace_data(table)
    T = len(table["original"])
    fig = go.Figure(
        go.Heatmap(
            z=d["z"],
            text=d["text"],
            customdata=d["customdata"],
            texttemplate="%{text}",
            textfont={"size": 11},
            zmin=-0.5,
            zmax=len(FATES) - 0.5,
            colorscale=_colorscale(),
            xgap=2,
            ygap=2,
            colorbar={
                "title": {"text": "fate"},
                "tickvals": list(range(len(FATES))),
                "ticktext": list(FATES),
                "len": 0.9,
            },
            hovertemplate="%{customdata}<extra></extra>",
        )
    )
    fig.update_yaxes(tickvals=[0, 1, 2], ticktext=list(ROWS), autorange="reversed", showgrid=False)
    fig.update_xaxes(title_text="token position", showgrid=False, range=[-0.5, T - 0.5])
    fig.update_layout(
        title={"text": _summary(table, state), "x": 0.01, "font": {"size": 14}},
        height=300,
        width=max(700, 62 * T + 260),
        margin={"l": 90, "r": 20, "t": 60, "b": 50},
        plot_bgcolor="white",
        meta={"onemask": "mlm_view", "state": {"sentence": state.sentence, "prob": state.prob, "seed": state.seed}},
    )
    if seeds:
        steps = []
        for s in range(state.seed, state.seed + seeds):
            st = replace(state, seed=s)
            tab = corruption_table(st)
            dd = _trace_data(tab)
            steps.append(
                {
                    "label": str(s),
                    "method": "update",
                    "args": [
                        {"z": [dd["z"]], "text": [dd["text"]], "customdata": [dd["customdata"]]},
                        {"title.text": _summary(tab, st)},
                    ],
                }
            )
        fig.update_layout(
            sliders=[
                {
                    "active": 0,
                    "steps": steps,
                    "currentvalue": {"prefix": "random draw (seed): "},
                    "pad": {"t": 50},
                    "len": 0.9,
                }
            ],
            height=380,
        )
    return fig


class MLMView(LiveView):
    """Live face: sentence box, probability and seed sliders, the figure redrawn in place."""

    def __init__(self, state: MLMState | None = None, **changes):
        import ipywidgets as W

        s = replace(state or MLMState(), **changes)
        style = {"description_width": "initial"}
        self.controls = {
            "sentence": W.Text(
                value=s.sentence,
                description="sentence",
                continuous_update=False,
                layout=W.Layout(width="600px"),
                style=style,
            ),
            "prob": W.FloatSlider(
                value=s.prob,
                min=0.0,
                max=1.0,
                step=0.05,
                description="selection probability",
                style=style,
                readout_format=".2f",
            ),
            "seed": W.IntSlider(value=s.seed, min=0, max=99, description="seed", style=style),
        }
        c = self.controls
        self._start(s, lambda figure: W.VBox([c["sentence"], W.HBox([c["prob"], c["seed"]]), figure]))

    def _figure(self, state: MLMState) -> go.Figure:
        return mlm_view_figure(state)
