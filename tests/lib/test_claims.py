"""The claims registry (lib.course.claims) and the ledger built from the executed lessons
(tools/build_claims.py -> book/claims.md)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from refusals import assert_refuses, refusal_test, rows

from lib.course.claims import (
    MIMETYPE,
    REQUIRED,
    SCALE,
    VERDICTS,
    Claim,
    _verdict,  # tests build every verdict directly; lessons go through the helpers
    arithmetic_if,
    check_required,
    claim,
    claims_in_notebook,
    needs_gpu,
    not_measurable,
    partly_reproduced_if,
    reproduced_if,
)

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("build_claims", ROOT / "tools" / "build_claims.py")
build_claims = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_claims)


def example(**changes) -> Claim:
    fields = dict(
        statement="A 7B model's cache is 34.35 GB",
        source="an article",
        verdict=reproduced_if(True),
        evidence="measured 34.36 GB",
    )
    fields.update(changes)
    return claim(changes.pop("id", "kv-cache-7b-34gb"), **{k: v for k, v in fields.items() if k != "id"})


def test_claim_accepts_each_verdict_and_normalises_whitespace():
    for verdict in VERDICTS:
        made = _verdict(verdict, "a larger run" if verdict == SCALE else None)
        c = example(verdict=made, evidence="two\n  lines")
        assert c.verdict == verdict
        assert c.evidence == ("two lines; would be decided at: a larger run" if verdict == SCALE else "two lines")


_NOT_DECIDED = (
    "claim verdict must be decided by reproduced_if, partly_reproduced_if, arithmetic_if, needs_gpu or "
    "not_measurable from the measurement, not given as"
)
_KEBAB = "claim id must be lower-case kebab-case like 'kv-cache-7b-34gb', got"
GOOD_CLAIM = dict(
    id="kv-cache-7b-34gb",
    statement="A 7B model's cache is 34.35 GB",
    source="an article",
    verdict=reproduced_if(True),
    evidence="measured 34.36 GB",
)
CLAIM_REFUSALS = [
    # a literal, even a valid one, is refused: verdicts come from the helpers that take the measurement
    *[
        ("verdict", v, TypeError, f"{_NOT_DECIDED} {v!r}")
        for v in ["reproduced", "contradicted", "needs a GPU", "Reproduced", "ok", "", None, True]
    ],
    (
        "verdict",
        _verdict(SCALE),
        ValueError,
        "claim 'kv-cache-7b-34gb': a 'not reproduced at this scale' verdict needs the scale at which the claim "
        "would be decided",
    ),
    *[
        ("id", bad, ValueError, f"{_KEBAB} {bad!r}")
        for bad in ["KV cache", "kv_cache", "-kv", "kv-", "", 7, "kv--cache"]
    ],
    ("evidence", "   ", ValueError, "claim evidence must not be empty"),
    ("statement", 34.35, TypeError, "claim statement must be a str, got float: 34.35"),
    ("evidence", "x" * 601, ValueError, "claim evidence is 601 characters; keep it under 600 (one line of the ledger)"),
    ("source", "x" * 201, ValueError, "claim source is 201 characters; keep it under 200 (one line of the ledger)"),
]
test_claim_refusals = refusal_test(claim, GOOD_CLAIM, CLAIM_REFUSALS)


def test_claim_takes_its_fields_after_the_statement_by_keyword():
    with pytest.raises(TypeError, match=r"^claim\(\) takes 2 positional arguments but 5 were given$"):
        claim("a", "s", "source given positionally", reproduced_if(True), "e")


def test_each_helper_decides_its_verdicts_from_the_measurement():
    assert (
        partly_reproduced_if(True, True),
        partly_reproduced_if(False, True),
        partly_reproduced_if(False, False),
    ) == ("reproduced", "partly reproduced", "contradicted")
    assert arithmetic_if(2 * 7 == 14) == "arithmetic" and arithmetic_if(2 * 7 == 15) == "contradicted"
    assert (
        needs_gpu("an A100 to time") == "needs a GPU"
        and not_measurable("no model is large enough") == "not measurable here"
    )


def _condition(helper, bad):
    return f"{helper} needs the measured condition (a bool), got {bad!r}"


def _several(helper, kind):
    return (
        f"{helper} needs one measured condition (a bool), got {kind} of several values: reduce it with .all() or .any()"
    )


_NEEDS_DECIDED_AT = (
    "reproduced_if(otherwise='not reproduced at this scale') needs decided_at: the scale at which the claim "
    "would be decided (a non-empty str), got"
)
# fmt: off
REPRODUCED_IF_REFUSALS = [
    # a capability, not an outcome of the measurement
    ("otherwise", "needs a GPU", ValueError,
     "otherwise must be 'contradicted' or 'not reproduced at this scale', got 'needs a GPU'"),
    ("holds", None, TypeError, _condition("reproduced_if", None)),
    ("holds", "yes", TypeError, _condition("reproduced_if", "yes")),
    ("holds", b"yes", TypeError, _condition("reproduced_if", b"yes")),
    ("holds", torch.tensor([True, False]), TypeError, _several("reproduced_if", "Tensor")),
    ("holds", np.array([True, False]), TypeError, _several("reproduced_if", "ndarray")),
    # not reproduced at this scale must name the scale that would decide it
    *[
        ("otherwise, decided_at", (SCALE, bad), TypeError, f"{_NEEDS_DECIDED_AT} {bad!r}")
        for bad in [None, "", "   ", 3]
    ],
    # contradicted needs no promise
    ("decided_at", "BERT-base", ValueError,
     "decided_at goes with otherwise='not reproduced at this scale' only, got otherwise='contradicted'"),
]
# fmt: on
test_reproduced_if_refusals = refusal_test(reproduced_if, dict(holds=False), REPRODUCED_IF_REFUSALS)


# fmt: off
PARTLY_REPRODUCED_IF_REFUSALS = [
    ("every, some", (True, False), ValueError,
     "partly_reproduced_if: every part holds but not some: pass the two measured conditions"),
    ("every", None, TypeError, _condition("partly_reproduced_if", None)),
    ("some", None, TypeError, _condition("partly_reproduced_if", None)),
    ("every", torch.tensor([True, False]), TypeError, _several("partly_reproduced_if", "Tensor")),
]
# fmt: on
test_partly_reproduced_if_refusals = refusal_test(
    partly_reproduced_if, dict(every=False, some=True), PARTLY_REPRODUCED_IF_REFUSALS
)


ARITHMETIC_IF_REFUSALS = [
    ("holds", None, TypeError, _condition("arithmetic_if", None)),
    ("holds", "yes", TypeError, _condition("arithmetic_if", "yes")),
    ("holds", np.array([True, False]), TypeError, _several("arithmetic_if", "ndarray")),
]
test_arithmetic_if_refusals = refusal_test(arithmetic_if, dict(holds=True), ARITHMETIC_IF_REFUSALS)


# needs_gpu and not_measurable refuse alike; {} is the helper's name
REASON_REFUSALS = [
    ("reason", "  ", TypeError, "{} needs the reason this machine cannot measure the claim, got '  '"),
    ("reason", None, TypeError, "{} needs the reason this machine cannot measure the claim, got None"),
    ("reason", 3, TypeError, "{} needs the reason this machine cannot measure the claim, got 3"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(REASON_REFUSALS))
@pytest.mark.parametrize("helper", [needs_gpu, not_measurable], ids=lambda h: h.__name__)
def test_reason_refusals(argument, bad, error, message, helper):
    assert_refuses(helper, dict(reason="an A100 to time"), argument, bad, error, message.format(helper.__name__))


def test_reproduced_if_decides_from_the_condition():
    assert reproduced_if(3 < 4) == "reproduced" and reproduced_if(0.5 > 1) == "contradicted"
    scale, at = SCALE, "a 1B model trained 100k steps"
    assert reproduced_if(0.5 > 1, otherwise=scale, decided_at=at) == scale
    assert reproduced_if(3 < 4, otherwise=scale, decided_at=at) == "reproduced"
    assert reproduced_if(torch.tensor(2.0) > 1) == "reproduced"


def test_the_deciding_scale_joins_the_evidence_and_survives_the_round_trip():
    made = example(
        verdict=reproduced_if(False, otherwise=SCALE, decided_at="BERT-base, 12 layers"), evidence="64-wide models"
    )
    assert made.evidence == "64-wide models; would be decided at: BERT-base, 12 layers"
    assert Claim.from_dict(made.to_dict()) == made


_RECORD = dict(GOOD_CLAIM, verdict="reproduced")
_FIELDS = "a claim record has exactly the fields ('id', 'statement', 'source', 'verdict', 'evidence');"
# fmt: off
FROM_DICT_REFUSALS = [
    (
        "data",
        dict(_RECORD, verdict=SCALE, evidence="64-wide models"),  # a record that promises nothing
        ValueError,
        "claim 'kv-cache-7b-34gb': a 'not reproduced at this scale' record's evidence must say the scale at which it "
        "would be decided ('would be decided at: ...'), got '64-wide models'",
    ),
    ("data", {"id": "x"}, ValueError,
     f"{_FIELDS} missing ['statement', 'source', 'verdict', 'evidence'], unexpected []"),
    ("data", dict(_RECORD, x=1), ValueError, f"{_FIELDS} missing [], unexpected ['x']"),
    ("data", [1], TypeError, "a claim record is a dict, got list"),
    ("data", dict(_RECORD, verdict="ok"), ValueError, f"claim verdict must be one of {VERDICTS}, got 'ok'"),
]
# fmt: on
test_claim_from_dict_refusals = refusal_test(Claim.from_dict, dict(data=_RECORD), FROM_DICT_REFUSALS)


def test_display_bundle_is_readable_deterministic_and_round_trips():
    c = example(evidence="a < b & c | d")
    bundle = c._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html", MIMETYPE}
    assert bundle == example(evidence="a < b & c | d")._repr_mimebundle_()  # same fields, same bytes
    assert "[reproduced] kv-cache-7b-34gb" in bundle["text/plain"]
    assert "a &lt; b &amp; c | d" in bundle["text/html"] and 'id="claim-kv-cache-7b-34gb"' in bundle["text/html"]
    stored = json.loads(json.dumps(bundle[MIMETYPE]))  # as a notebook stores it
    assert Claim.from_dict(stored) == c


def test_claims_in_notebook_reads_displayed_claims_in_cell_order():
    a, b = example(), example(id="weights-7b-14gb")
    nb = {
        "cells": [
            {"cell_type": "markdown", "source": "x"},
            {
                "cell_type": "code",
                "outputs": [
                    {"output_type": "stream", "text": "hi"},
                    {"output_type": "execute_result", "data": b._repr_mimebundle_()},
                ],
            },
            {"cell_type": "code", "outputs": [{"output_type": "display_data", "data": a._repr_mimebundle_()}]},
        ]
    }
    assert claims_in_notebook(nb) == [(1, b), (2, a)]


def test_check_required_passes_each_required_claim_made_once():
    assert check_required(["a", "b"], required=("a",)) is None


_LEDGER_HINT = "(run the lessons that measure them, or give each claim one id)"
# fmt: off
CHECK_REQUIRED_REFUSALS = [
    ("required", ("a", "c"), ValueError,
     f"claims ledger: required claims missing ['c']; claims registered more than once [] {_LEDGER_HINT}"),
    ("ids", ["a", "a"], ValueError,
     f"claims ledger: required claims missing []; claims registered more than once ['a'] {_LEDGER_HINT}"),
]
# fmt: on
test_check_required_refusals = refusal_test(
    check_required, dict(ids=["a", "b"], required=("a",)), CHECK_REQUIRED_REFUSALS
)


def test_every_required_claim_is_registered_exactly_once_by_the_lessons():
    ids = [c.id for _, _, c in build_claims.collect(build_claims.notebooks())]
    check_required(ids)
    assert len(ids) == len(set(ids))
    assert set(REQUIRED) <= set(ids)


def test_committed_ledger_is_what_the_notebooks_generate():
    assert build_claims.LEDGER.read_text() == build_claims.render(build_claims.notebooks()), (
        "book/claims.md is stale: run python tools/build_claims.py"
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_claims.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ledger_build_fails_loudly_without_a_required_claim(tmp_path):
    nb = {
        "cells": [
            {"cell_type": "code", "outputs": [{"output_type": "display_data", "data": example()._repr_mimebundle_()}]}
        ]
    }
    path = tmp_path / "01-masking-equation.ipynb"
    path.write_text(json.dumps(nb))
    with pytest.raises(ValueError, match="required claims missing"):
        build_claims.render([path])


def test_verdict_summary_lists_each_claim_made_in_this_process_once_with_its_latest_verdict():
    from lib.course.claims import registered, verdict_summary

    claim("test-verdicts-a", "A holds", source="test", verdict=reproduced_if(True), evidence="measured a")
    claim("test-verdicts-b", "B holds", source="test", verdict=reproduced_if(False), evidence="measured b")
    claim("test-verdicts-a", "A holds", source="test", verdict=reproduced_if(False), evidence="measured again")
    lines = [line for line in verdict_summary().splitlines() if "test-verdicts" in line]
    assert lines == ["✘ contradicted                 test-verdicts-a", "✘ contradicted                 test-verdicts-b"]
    assert [c.id for c in registered() if c.id.startswith("test-verdicts")] == ["test-verdicts-a", "test-verdicts-b"]


def test_verdict_summary_lists_timed_claims_without_their_verdict():
    """A verdict decided by wall time can flip on a busy machine: the compared summary names it only."""
    from lib.course.claims import verdict_summary

    claim("test-timed-a", "A is slower", source="test", verdict=reproduced_if(True), evidence="1.3x the time")
    claim("test-timed-b", "B is smaller", source="test", verdict=reproduced_if(True), evidence="half the bytes")
    lines = [line for line in verdict_summary(timed=["test-timed-a"]).splitlines() if "test-timed" in line]
    assert lines == ["⏱ timed on this CPU            test-timed-a", "✔ reproduced                   test-timed-b"]
    before = verdict_summary(timed={"test-timed-a"})
    claim("test-timed-a", "A is slower", source="test", verdict=reproduced_if(False), evidence="0.9x on a busy machine")
    assert verdict_summary(timed={"test-timed-a"}) == before  # the flip does not show in the compared list
    assert "✘ contradicted                 test-timed-a" in verdict_summary()  # but does without `timed`


VERDICT_SUMMARY_REFUSALS = [
    ("timed", "test-timed-a", TypeError, "timed is a collection of claim ids, got the string 'test-timed-a'"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(VERDICT_SUMMARY_REFUSALS))
def test_verdict_summary_refusals(argument, bad, error, message):
    from lib.course.claims import verdict_summary

    assert_refuses(verdict_summary, dict(timed=()), argument, bad, error, message)


def test_verdict_summary_refuses_an_unregistered_timed_id():
    """The message ends with every claim registered in this process, which depends on the tests run
    before: only its stable start is matched."""
    from lib.course.claims import verdict_summary

    with pytest.raises(ValueError) as info:
        verdict_summary(timed=["test-timed-zzz"])
    assert str(info.value).startswith(
        "timed names claims not registered in this kernel: ['test-timed-zzz'] (registered: ["
    ), str(info.value)


FALSY = [False, 0, 0.0, "numpy False", "tensor False", "numpy 0.0"]
TRUTHY = [True, 1, 2.5, "numpy True", "tensor True"]


def _value(v):
    named = {
        "numpy False": np.False_,
        "tensor False": torch.tensor(False),
        "numpy 0.0": np.float64(0.0),
        "numpy True": np.True_,
        "tensor True": torch.tensor(True),
    }
    return named.get(v, v) if isinstance(v, str) else v


@pytest.mark.parametrize("holds", FALSY, ids=str)
def test_verdict_helpers_read_a_falsy_measured_condition_as_not_holding(holds):
    """A condition computed with numpy or torch is a numpy or tensor boolean, or a number: its truth
    value decides, not its identity (a helper testing `holds is not False` would pass them all)."""
    assert reproduced_if(_value(holds)) == "contradicted"
    assert reproduced_if(_value(holds), otherwise=SCALE, decided_at="a larger run") == SCALE
    assert arithmetic_if(_value(holds)) == "contradicted"
    assert partly_reproduced_if(_value(holds), _value(holds)) == "contradicted"
    assert partly_reproduced_if(_value(holds), True) == "partly reproduced"


@pytest.mark.parametrize("holds", TRUTHY, ids=str)
def test_verdict_helpers_read_a_truthy_measured_condition_as_holding(holds):
    assert reproduced_if(_value(holds)) == "reproduced"
    assert arithmetic_if(_value(holds)) == "arithmetic"
    assert partly_reproduced_if(_value(holds), _value(holds)) == "reproduced"
