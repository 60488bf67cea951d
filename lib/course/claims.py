"""The claims ledger: quantitative claims registered by the lesson cells that measure them.

A lesson cell that measures something a source article (or the lesson itself) states calls

    claim("kv-cache-7b-34gb", "A 7B model's KV cache at batch 16 x 4096 tokens is 34.35 GB",
          source="Transformer Architectures Compared (31 May 2024)", verdict=reproduced_if(abs(gb - 34.35) < 0.01),
          evidence=f"kv_cache_bytes(...) = {cache:,} bytes = {cache / 1e9:.2f} GB")

and the returned `Claim` displays as one readable line (text/plain, text/html) that also carries
its fields as JSON under `MIMETYPE`. `tools/build_claims.py` reads those outputs back from the
executed notebooks and writes the book's ledger, so the ledger is generated, never typed: the
verdict is decided by code from the measured numbers, and the evidence is a string the cell
formats from them.

Verdicts, each from the helper that decides it, never typed:

    reproduced_if(holds)                      "reproduced" or "contradicted": measured here
    reproduced_if(holds, otherwise=SCALE,     ... or "not reproduced at this scale": the claim is about
                  decided_at="...")           models or runs larger than the course makes; the
                                              evidence states the scale measured, and `decided_at`
                                              the scale at which the claim would be decided (the
                                              ledger appends it to the evidence)
    partly_reproduced_if(every, some)         "reproduced" when every part holds, "partly reproduced"
                                              when some do, else "contradicted": a range checked at
                                              both ends, or every point of a domain judged
    arithmetic_if(holds)                      "arithmetic" or "contradicted": an identity the cell
                                              computes (a product of published sizes), not an
                                              observation
    needs_gpu(reason) / not_measurable(reason) a capability this machine lacks, and why

`claim()` takes only what these return (a `Verdict`), so a literal string cannot stand in for a
measurement; tests/project/test_project.py also checks, over the lessons, that no cell asserts a claim's
own condition before registering it (a failing measurement must be recorded, not crash the cell).
`REQUIRED` lists the claims the course promises to check; the build fails without each of them.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "MIMETYPE",
    "REQUIRED",
    "SCALE",
    "VERDICTS",
    "Claim",
    "Verdict",
    "arithmetic_if",
    "check_required",
    "claim",
    "claims_in_notebook",
    "needs_gpu",
    "not_measurable",
    "partly_reproduced_if",
    "registered",
    "reproduced_if",
    "verdict_summary",
]

MIMETYPE = "application/vnd.onemask.claim+json"
SCALE = "not reproduced at this scale"
VERDICTS = (
    "reproduced",
    "partly reproduced",
    "contradicted",
    SCALE,
    "arithmetic",
    "needs a GPU",
    "not measurable here",
)
_ID = re.compile(r"^[a-z0-9]+(?:[-.][a-z0-9]+)*$")
_MARK = {
    "reproduced": "✔",
    "partly reproduced": "◐",
    "contradicted": "✘",
    SCALE: "≁",
    "arithmetic": "=",
    "needs a GPU": "⚙",
    "not measurable here": "–",
}


class Verdict(str):
    """A verdict as one of the helpers below decided it (a str subclass `claim` requires).

    `decided_at`: for SCALE, the scale at which the claim would be decided (None otherwise)."""

    decided_at: str | None = None


def _verdict(value: str, decided_at: str | None = None) -> Verdict:
    assert value in VERDICTS, value
    made = Verdict(value)
    made.decided_at = decided_at
    return made


_IN_EVIDENCE = ""  # decided_at of a verdict read back from a record: the evidence already says it
_DECIDED_AT = "would be decided at: "

# The claims the course must check, by id: a lesson that drops one fails tests/lib/test_claims.py.
REQUIRED: tuple[str, ...] = (
    "kv-cache-7b-34gb",  # a 7B model's KV cache, batch 16 x 4096 tokens, fp16: 34.35 GB
    "weights-7b-14gb",  # its weights in fp16: 14 GB
    "kv-contiguous-waste-20-35pct",  # 20-35% of KV memory wasted without paging
    "rtx4090-attention-table",  # the naive / SDPA / Triton timing and memory table on an RTX 4090
    "kv-cache-linear-decode",  # the KV cache turns O(S^2) generation into O(S)
    "mamba-constant-inference-memory",  # Mamba decodes with O(1) memory
    "mamba-linear-scan",  # Mamba's scan is O(S)
    "moe-8x-top2-dense-cost",  # 8 experts, top-2, cost like a dense model
    "moe-alpha-below-1e-3-collapses",  # alpha < 1e-3 collapses within 500 steps
    "moe-alpha-above-1e-1-uniform",  # alpha > 1e-1 forces uniform routing at the expense of loss
    "moe-alpha-0.01-capacity-1.25-drops",  # alpha = 0.01, C = 1.25 drops < 0.1% of tokens
    "bert-vs-gpt-classification-10-50x",  # BERT-style 10-50x faster at classification inference
    "bert-classification-10k-rps-a100",  # classification at 10K+ requests/s on one A100
    "bert-mlm-80-10-10",  # of the selected tokens, 80% [MASK], 10% random, 10% unchanged
    "bert-mlm-15pct",  # 15% of the tokens selected for masking
)


def _text(name: str, value: Any, *, max_len: int = 600) -> str:
    if not isinstance(value, str):
        raise TypeError(f"claim {name} must be a str, got {type(value).__name__}: {value!r}")
    value = " ".join(value.split())  # one line: the ledger is a table
    if not value:
        raise ValueError(f"claim {name} must not be empty")
    if len(value) > max_len:
        raise ValueError(f"claim {name} is {len(value)} characters; keep it under {max_len} (one line of the ledger)")
    return value


@dataclass(frozen=True)
class Claim:
    """One registered claim. Build it with `claim(...)`, which validates every field."""

    id: str
    statement: str
    source: str
    verdict: str
    evidence: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Claim":
        if not isinstance(data, dict):
            raise TypeError(f"a claim record is a dict, got {type(data).__name__}")
        fields = ("id", "statement", "source", "verdict", "evidence")
        missing = [f for f in fields if f not in data]
        extra = [k for k in data if k not in fields]
        if missing or extra:
            raise ValueError(f"a claim record has exactly the fields {fields}; missing {missing}, unexpected {extra}")
        if data["verdict"] not in VERDICTS:
            raise ValueError(f"claim verdict must be one of {VERDICTS}, got {data['verdict']!r}")
        if data["verdict"] == SCALE and _DECIDED_AT not in str(data["evidence"]):
            raise ValueError(
                f"claim {data['id']!r}: a {SCALE!r} record's evidence must say the scale at which it "
                f"would be decided ('{_DECIDED_AT}...'), got {data['evidence']!r}"
            )
        return claim(
            data["id"],
            data["statement"],
            source=data["source"],
            verdict=_verdict(data["verdict"], _IN_EVIDENCE),
            evidence=data["evidence"],
        )

    def __str__(self) -> str:
        head = f"{_MARK[self.verdict]} [{self.verdict}] {self.id}"
        return f"{head}: {self.statement} — {self.evidence} (source: {self.source})"

    def _repr_html_(self) -> str:
        e = html.escape
        return (
            f'<div class="onemask-claim" id="claim-{e(self.id)}"><strong>Claim {e(self.id)}</strong> '
            f"<strong>{_MARK[self.verdict]} {e(self.verdict)}</strong>: {e(self.statement)}<br>"
            f"<em>Measured:</em> {e(self.evidence)}<br><em>Source:</em> {e(self.source)}</div>"
        )

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, Any]:
        # Deterministic: the same fields give the same bytes (nbval compares stored outputs).
        return {"text/plain": str(self), "text/html": self._repr_html_(), MIMETYPE: self.to_dict()}


def claim(id: str, statement: str, *, source: str, verdict: str, evidence: str) -> Claim:
    """Register a claim where it is measured; display the result as the cell's last expression.

    id: a short kebab-case name, unique across the course (e.g. "kv-cache-7b-34gb").
    statement: the claim as its source states it. source: who states it (article, paper, lesson).
    verdict: what `reproduced_if`, `partly_reproduced_if`, `arithmetic_if`, `needs_gpu` or
      `not_measurable` returned for the measurement (a literal string is refused).
    evidence: what was measured, formatted from the cell's values (never typed numbers). For a
      SCALE verdict, "; would be decided at: <decided_at>" is appended.
    """
    if not isinstance(id, str) or not _ID.match(id):
        raise ValueError(f"claim id must be lower-case kebab-case like 'kv-cache-7b-34gb', got {id!r}")
    if not isinstance(verdict, Verdict):
        raise TypeError(
            f"claim verdict must be decided by reproduced_if, partly_reproduced_if, arithmetic_if, "
            f"needs_gpu or not_measurable from the measurement, not given as {verdict!r}"
        )
    evidence = _text("evidence", evidence)
    if verdict == SCALE:
        if verdict.decided_at is None:  # only reproduced_if(..., otherwise=SCALE, decided_at=...) makes SCALE
            raise ValueError(f"claim {id!r}: a {SCALE!r} verdict needs the scale at which the claim would be decided")
        if verdict.decided_at:
            evidence = _text("evidence", f"{evidence}; {_DECIDED_AT}{verdict.decided_at}")
    made = Claim(id, _text("statement", statement), _text("source", source, max_len=200), str(verdict), evidence)
    _REGISTERED[id] = made
    return made


_REGISTERED: dict[str, Claim] = {}  # this process's claims by id, in the order first made (a re-run replaces)


def registered() -> list[Claim]:
    """Every claim made in this process (this kernel), in order; the latest verdict of each id."""
    return list(_REGISTERED.values())


def verdict_summary(timed: Iterable[str] = ()) -> str:
    """One line per claim made in this kernel: "verdict  id". A lesson prints it last, in a cell
    nbval compares, so a verdict that changes with the CPU's rounding fails the suite even where
    the evidence's digits are not compared (runs whose training is chaotic at this scale).

    `timed`: ids of claims decided by wall-clock time on this machine (another machine, or a busy
    one, may decide them the other way); they are listed without their verdict. Each must have
    been registered in this kernel."""
    if isinstance(timed, str):
        raise TypeError(f"timed is a collection of claim ids, got the string {timed!r}")
    timed = set(timed)
    unknown = sorted(timed - set(_REGISTERED))
    if unknown:
        raise ValueError(
            f"timed names claims not registered in this kernel: {unknown} (registered: {sorted(_REGISTERED)})"
        )
    lines = []
    for c in _REGISTERED.values():
        mark, verdict = ("⏱", "timed on this CPU") if c.id in timed else (_MARK[c.verdict], c.verdict)
        lines.append(f"{mark} {verdict:28s} {c.id}")
    return "\n".join(lines)


def _condition(name: str, holds: Any) -> bool:
    if holds is None or isinstance(holds, (str, bytes)):
        raise TypeError(f"{name} needs the measured condition (a bool), got {holds!r}")
    try:
        return bool(holds)  # numpy and torch booleans, and numbers, by their truth value
    except (RuntimeError, ValueError) as err:  # an array or tensor of several values
        raise TypeError(
            f"{name} needs one measured condition (a bool), got {type(holds).__name__} "
            f"of several values: reduce it with .all() or .any()"
        ) from err


def reproduced_if(holds: Any, *, otherwise: str = "contradicted", decided_at: str | None = None) -> Verdict:
    """ "reproduced" when the measured condition holds, else `otherwise`: "contradicted", or SCALE
    ("not reproduced at this scale") for a claim about models or runs larger than the course can
    make. SCALE is a promise: `decided_at` names the scale at which the claim would be decided
    (model size, training length, sequence length, hardware), and the evidence states the scale
    measured here."""
    if otherwise not in ("contradicted", SCALE):
        raise ValueError(f"otherwise must be 'contradicted' or '{SCALE}', got {otherwise!r}")
    if otherwise == SCALE:
        if not isinstance(decided_at, str) or not decided_at.strip():
            raise TypeError(
                f"reproduced_if(otherwise='{SCALE}') needs decided_at: the scale at which the claim "
                f"would be decided (a non-empty str), got {decided_at!r}"
            )
    elif decided_at is not None:
        raise ValueError(f"decided_at goes with otherwise='{SCALE}' only, got otherwise={otherwise!r}")
    return _verdict(
        "reproduced" if _condition("reproduced_if", holds) else otherwise, decided_at if otherwise == SCALE else None
    )


def partly_reproduced_if(every: Any, some: Any) -> Verdict:
    """ "reproduced" when every part of the claim holds (a range at both ends, every measured point of
    its domain), "partly reproduced" when only some do, "contradicted" when none does."""
    every, some = _condition("partly_reproduced_if", every), _condition("partly_reproduced_if", some)
    if every and not some:
        raise ValueError("partly_reproduced_if: every part holds but not some: pass the two measured conditions")
    return _verdict("reproduced" if every else "partly reproduced" if some else "contradicted")


def arithmetic_if(holds: Any) -> Verdict:
    """ "arithmetic" when the computed identity holds (a claim true by multiplying published sizes,
    which the cell recomputes), "contradicted" when the source's arithmetic is wrong."""
    return _verdict("arithmetic" if _condition("arithmetic_if", holds) else "contradicted")


def _reason(name: str, reason: Any) -> str:
    if not isinstance(reason, str) or not reason.strip():
        raise TypeError(f"{name} needs the reason this machine cannot measure the claim, got {reason!r}")
    return reason


def needs_gpu(reason: str) -> Verdict:
    """ "needs a GPU": the claim is about a GPU's speed or memory, which this machine lacks; `reason`
    says which GPU and what would measure it (the evidence repeats it)."""
    _reason("needs_gpu", reason)
    return _verdict("needs a GPU")


def not_measurable(reason: str) -> Verdict:
    """ "not measurable here": nothing the course can run decides the claim; `reason` says why."""
    _reason("not_measurable", reason)
    return _verdict("not measurable here")


def claims_in_notebook(notebook: dict | str | Path) -> list[tuple[int, Claim]]:
    """(cell index, Claim) for every claim a cell of an executed notebook displayed, in order."""
    nb = json.loads(Path(notebook).read_text()) if isinstance(notebook, (str, Path)) else notebook
    found = []
    for index, cell in enumerate(nb.get("cells", [])):
        for output in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = output.get("data", {})
            if MIMETYPE in data:
                record = data[MIMETYPE]
                found.append((index, Claim.from_dict(json.loads(record) if isinstance(record, str) else record)))
    return found


def check_required(ids: Iterable[str], required: Iterable[str] = REQUIRED) -> None:
    """Raise ValueError unless every required id appears exactly once (and no id twice)."""
    ids = list(ids)
    counts = {i: ids.count(i) for i in set(ids)}
    missing = [r for r in required if r not in counts]
    repeated = sorted(i for i, n in counts.items() if n > 1)
    if missing or repeated:
        raise ValueError(
            f"claims ledger: required claims missing {missing}; claims registered more than once "
            f"{repeated} (run the lessons that measure them, or give each claim one id)"
        )
