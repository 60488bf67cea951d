"""The student's install leaves out what the course never runs: the dependencies that bertviz,
mpld3 and the weights' packages declare (boto3 for bertviz's neuron view, matplotlib for mpld3's
plots, sentence-transformers with scikit-learn and scipy for all-MiniLM-L6-v2's own loader), and
nbclassic, a whole notebook frontend once installed for its copies of jQuery and Font Awesome
(now from xstatic-jquery and xstatic-font-awesome, which hold those files alone).
Those packages come from requirements-weights.txt with --no-deps; the course, its widgets and the
views still work with every left-out package made unimportable."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = (
    "scipy",
    "sklearn",
    "sentence_transformers",
    "matplotlib",
    "boto3",
    "botocore",
    "sentencepiece",
    "nbclassic",
)
LEFT_OUT_DISTS = (
    "scipy",
    "scikit-learn",
    "sentence-transformers",
    "matplotlib",
    "boto3",
    "botocore",
    "sentencepiece",
    "pillow",
    "nbclassic",
)


def _names(lock: str) -> set[str]:
    return {
        re.sub(r"[-_.]+", "-", m.group(1)).lower() for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)==", lock, re.M)
    }


def test_the_students_lock_and_the_hub_image_leave_the_unused_dependencies_out():
    for name in ("requirements.lock", "binder/requirements.txt"):
        assert not _names((ROOT / name).read_text()) & set(LEFT_OUT_DISTS), name


def _site_without_left_out(tmp_path: Path) -> Path:
    """A copy (of links) of this environment's site-packages without the left-out packages and
    their metadata: to Python, and to transformers' checks of what is installed, they are absent."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    view = tmp_path / "site-packages"
    view.mkdir()
    left_out = {re.sub(r"[-_.]+", "_", n).lower() for n in LEFT_OUT + LEFT_OUT_DISTS}
    for entry in site.iterdir():
        top = re.split(r"-\d|\.dist-info|\.libs|\.py$", entry.name)[0]
        if re.sub(r"[-_.]+", "_", top).lower() not in left_out:
            (view / entry.name).symlink_to(entry)
    return view


USE = """
import torch
import lib, widgets
from lib.bert import load_minilm
from widgets.bertviz_offline import head_view, model_view

model, tok = load_minilm()
ids = tok(["the cat sat", "a dog"], padding=True, return_tensors="pt")
with torch.no_grad():
    hidden, attentions = model(ids["input_ids"], ids["attention_mask"], return_attentions=True)
tokens = tok.convert_ids_to_tokens(ids["input_ids"][0])
html = head_view([a[:1] for a in attentions], tokens).html
assert "window.d3" in html and "jQuery" in html and "https://" not in html.split("<script>", 1)[0]
model_view([a[:1] for a in attentions], tokens)
import pathlib, sys, tempfile
sys.path.insert(0, "tools")
import make_gallery
template = make_gallery.write_template(pathlib.Path(tempfile.mkdtemp()))
assert (template / "static" / "font-awesome" / "fonts" / "fontawesome-webfont.woff2").is_file()
print("views", len(html))
"""


def _run_without(view: Path, code: str):
    # -S: no site-packages but the view (addsitedir also reads its .pth files: the course's editable install)
    start = f"import site; site.addsitedir({str(view)!r})\n"
    return subprocess.run(
        [sys.executable, "-S", "-c", start + code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_the_bert_views_and_minilm_work_without_the_left_out_packages(tmp_path):
    view = _site_without_left_out(tmp_path)
    proc = _run_without(view, USE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("views")
    for name in LEFT_OUT:  # and the check means something: each is really absent there
        proc = _run_without(view, f"import importlib.util; assert importlib.util.find_spec({name!r}) is None")
        assert proc.returncode == 0, (name, proc.stderr[-500:])
    proc = _run_without(view, "import mpld3")  # installed for its d3 file only: importing it would fail
    assert proc.returncode != 0 and "matplotlib" in proc.stderr
