"""Every figure in an executed lesson has a caption saying what to notice, so a screen-reader user
(and the book's search) gets the point without the picture."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NBS = sorted((ROOT / "lessons").glob("[0-9][0-9]-*.ipynb"))
PLOTLY = "application/vnd.plotly.v1+json"
CAPTION = re.compile(r"^\*{1,2}What to notice:?\*{1,2}:?\s+\S")  # *What to notice:* or **What to notice:**


def paragraphs(cell) -> list[str]:
    text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def is_captioned(cells: list[dict], i: int) -> bool:
    """The next markdown cell opens with the caption, or the previous one ends with it."""
    after = cells[i + 1] if i + 1 < len(cells) else None
    before = cells[i - 1] if i > 0 else None
    if (
        after is not None
        and after["cell_type"] == "markdown"
        and paragraphs(after)
        and CAPTION.match(paragraphs(after)[0])
    ):
        return True
    return bool(
        before is not None
        and before["cell_type"] == "markdown"
        and paragraphs(before)
        and CAPTION.match(paragraphs(before)[-1])
    )


def test_caption_rule_accepts_a_caption_after_or_before_and_nothing_else():
    fig = {"cell_type": "code", "source": "fig.show()", "outputs": []}
    md = lambda text: {"cell_type": "markdown", "source": text}  # noqa: E731
    assert is_captioned([fig, md("*What to notice:* the line is flat.\n\nMore prose.")], 0)
    assert is_captioned([md("Intro.\n\n**What to notice:** bars grow."), fig], 1)
    assert not is_captioned([fig, md("More prose.\n\n*What to notice:* too late.")], 0)
    assert not is_captioned([md("*What to notice:* belongs to an earlier figure.\n\nIntro."), fig], 1)
    assert not is_captioned([fig, {"cell_type": "code", "source": "x", "outputs": []}], 0)


@pytest.mark.parametrize("nb", NBS, ids=lambda p: p.stem)
def test_every_figure_output_has_a_what_to_notice_caption_beside_it(nb):
    cells = json.loads(nb.read_text())["cells"]
    figures = [
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "code" and any(PLOTLY in out.get("data", {}) for out in c.get("outputs", []))
    ]
    missing = [
        f"cell {i}: {''.join(cells[i]['source']).strip().splitlines()[-1][:70]}"
        for i in figures
        if not is_captioned(cells, i)
    ]
    assert not missing, (
        f"{nb.name}: figures without a '*What to notice:* ...' caption in the markdown right after "
        f"(or right before) them: {missing}"
    )
