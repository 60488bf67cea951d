"""Copy the JavaScript the book serves itself into book/_static (generated, not committed).

plotly.js comes from the installed `plotly` package, MathJax 3 (tex-svg-full, one file, fonts
inlined as SVG paths) from the `django-static-mathjax` package, so the built site makes no
request outside itself and builds with no network.
"""

import shutil
from pathlib import Path

import mathjax
import plotly

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "book" / "_static"


def main() -> None:
    (STATIC / "mathjax").mkdir(parents=True, exist_ok=True)
    shutil.copy2(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", STATIC / "plotly.min.js")
    mj = Path(mathjax.__path__[0]) / "static" / "mathjax" / "es5" / "tex-svg-full.js"
    shutil.copy2(mj, STATIC / "mathjax" / "tex-svg-full.js")
    print(f"copied plotly.js and MathJax into {STATIC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
