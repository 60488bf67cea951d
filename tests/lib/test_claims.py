"""The claims registry (lib.course.claims) and the ledger built from the executed lessons
(tools/build_claims.py -> book/claims.md)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("verdict", ["reproduced", "contradicted", "needs a GPU", "Reproduced", "ok", "", None, True])
def test_claim_refuses_a_verdict_the_measurement_did_not_decide(verdict):
    """A literal, even a valid one, is refused: verdicts come from the helpers that take the measurement."""
    with pytest.raises(TypeError, match="must be decided by reproduced_if"):
        example(verdict=verdict)


def test_each_helper_decides_its_verdicts_from_the_measurement():
    assert (
        partly_reproduced_if(True, True),
        partly_reproduced_if(False, True),
        partly_reproduced_if(False, False),
    ) == ("reproduced", "partly reproduced", "contradicted")
    with pytest.raises(ValueError, match="every part holds but not some"):
        partly_reproduced_if(True, False)
    assert arithmetic_if(2 * 7 == 14) == "arithmetic" and arithmetic_if(2 * 7 == 15) == "contradicted"
    assert (
        needs_gpu("an A100 to time") == "needs a GPU"
        and not_measurable("no model is large enough") == "not measurable here"
    )
    for helper in (needs_gpu, not_measurable):
        with pytest.raises(TypeError, match="reason"):
            helper("  ")
    for helper in (arithmetic_if, lambda x: partly_reproduced_if(x, True)):
        with pytest.raises(TypeError, match="measured condition"):
            helper(None)


@pytest.mark.parametrize("bad_id", ["KV cache", "kv_cache", "-kv", "kv-", "", 7, "kv--cache"])
def test_claim_rejects_an_id_that_is_not_kebab_case(bad_id):
    with pytest.raises(ValueError, match="kebab-case"):
        claim(bad_id, "s", source="s", verdict=reproduced_if(True), evidence="e")


def test_claim_rejects_empty_or_non_text_fields():
    with pytest.raises(ValueError, match="evidence must not be empty"):
        example(evidence="   ")
    with pytest.raises(TypeError, match="statement must be a str"):
        example(statement=34.35)
    with pytest.raises(ValueError, match="under 600"):
        example(evidence="x" * 601)
    with pytest.raises(TypeError):
        claim("a", "s", "source given positionally", reproduced_if(True), "e")  # keyword-only


def test_reproduced_if_decides_from_the_condition_and_refuses_non_conditions():
    assert reproduced_if(3 < 4) == "reproduced" and reproduced_if(0.5 > 1) == "contradicted"
    scale, at = SCALE, "a 1B model trained 100k steps"
    assert reproduced_if(0.5 > 1, otherwise=scale, decided_at=at) == scale
    assert reproduced_if(3 < 4, otherwise=scale, decided_at=at) == "reproduced"
    with pytest.raises(ValueError, match="otherwise must be 'contradicted' or 'not reproduced at this scale'"):
        reproduced_if(True, otherwise="needs a GPU")  # a capability, not an outcome of the measurement
    import torch

    assert reproduced_if(torch.tensor(2.0) > 1) == "reproduced"
    for bad in (None, "yes"):
        with pytest.raises(TypeError, match="measured condition"):
            reproduced_if(bad)


@pytest.mark.parametrize("decided_at", [None, "", "   ", 3])
def test_not_reproduced_at_this_scale_must_name_the_scale_that_would_decide_it(decided_at):
    with pytest.raises(TypeError, match="needs decided_at"):
        reproduced_if(False, otherwise=SCALE, decided_at=decided_at)


def test_the_deciding_scale_joins_the_evidence_and_survives_the_round_trip():
    made = example(
        verdict=reproduced_if(False, otherwise=SCALE, decided_at="BERT-base, 12 layers"), evidence="64-wide models"
    )
    assert made.evidence == "64-wide models; would be decided at: BERT-base, 12 layers"
    assert Claim.from_dict(made.to_dict()) == made
    with pytest.raises(ValueError, match="goes with otherwise"):
        reproduced_if(False, decided_at="BERT-base")  # contradicted needs no promise
    record = {**made.to_dict(), "evidence": "64-wide models"}  # a record that promises nothing
    with pytest.raises(ValueError, match="would be decided"):
        Claim.from_dict(record)


def test_display_bundle_is_readable_deterministic_and_round_trips():
    c = example(evidence="a < b & c | d")
    bundle = c._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html", MIMETYPE}
    assert bundle == example(evidence="a < b & c | d")._repr_mimebundle_()  # same fields, same bytes
    assert "[reproduced] kv-cache-7b-34gb" in bundle["text/plain"]
    assert "a &lt; b &amp; c | d" in bundle["text/html"] and 'id="claim-kv-cache-7b-34gb"' in bundle["text/html"]
    stored = json.loads(json.dumps(bundle[MIMETYPE]))  # as a notebook stores it
    assert Claim.from_dict(stored) == c
    with pytest.raises(ValueError, match="missing"):
        Claim.from_dict({"id": "x"})


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


def test_check_required_names_missing_and_repeated_claims():
    check_required(["a", "b"], required=("a",))
    with pytest.raises(ValueError, match=r"missing \['c'\]"):
        check_required(["a", "b"], required=("a", "c"))
    with pytest.raises(ValueError, match=r"more than once \['a'\]"):
        check_required(["a", "a"], required=("a",))


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
    with pytest.raises(ValueError, match="not registered in this kernel.*'test-timed-zzz'"):
        verdict_summary(timed=["test-timed-zzz"])
    with pytest.raises(TypeError, match="collection of claim ids"):
        verdict_summary(timed="test-timed-a")


FALSY = [False, 0, 0.0, "numpy False", "tensor False", "numpy 0.0"]
TRUTHY = [True, 1, 2.5, "numpy True", "tensor True"]


def _value(v):
    import numpy as np
    import torch

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


def test_a_condition_of_several_values_is_refused_by_name():
    import torch

    with pytest.raises(TypeError, match=r"reproduced_if needs one measured condition.*\.all\(\)"):
        reproduced_if(torch.tensor([True, False]))
