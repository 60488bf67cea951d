"""Exercise checks: run a learner's function on crafted cases and explain what went wrong.

Each lesson's checks live in `lib.course.exercises.lessonNN`. A check takes the learner's function,
runs it on cases chosen to expose the classic mistakes (T = 1, padding on both sides, very
negative scores), and returns a `CheckReport`. Its text is what the learner sees under the cell:
either a pass line, or the first failing case with a hint. It never raises for a wrong or
unfinished answer, so a student running an unsolved notebook sees hints, not stack traces.

The lessons hold the solutions between `### BEGIN SOLUTION` / `### END SOLUTION` markers;
`tools/make_exercises.py` writes the exercise notebooks with those lines replaced by a stub.

Predict, then reveal: where a lesson prints a library function whose source is an exercise's
answer (`ANSWERED_BY`), the exercise comes before that cell and the cell is tagged `answer`,
so the exercise notebook hides it (tests/exercises/test_notebooks.py checks both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["ANSWERED_BY", "Case", "CheckReport", "call_learner", "run_checks"]

# check function -> (module, qualified name) of the library code whose printed source answers it
ANSWERED_BY: dict[str, tuple[str, str]] = {
    "check_masked_attention": ("lib.attention", "safe_softmax"),
    "check_mlm_corrupt": ("lib.bert", "mlm_corrupt"),
    "check_clm_loss": ("lib.train", "clm_loss"),
    "check_cache_update": ("lib.kv_cache", "KVCache.update"),
    "check_online_softmax_update": ("lib.attention", "online_softmax_update"),
    "check_key_block_bounds": ("lib.kernels.flash", "key_block_bounds"),
    "check_ssm_step": ("lib.mamba", "SelectiveSSM.step"),
    "check_top_k_gating": ("lib.moe", "route_top_k"),
    "check_balance_loss": ("lib.moe", "switch_loss"),
}

Diagnose = Callable[[torch.Tensor], "str | None"]


@dataclass
class Case:
    """One input to try: `args` go to the learner's function, `expected` is lib's answer.

    `exact` demands bit equality (masks); otherwise values must be within atol/rtol.
    `diagnose(got)` may return a targeted hint when the answer is wrong.
    """

    name: str
    args: tuple
    expected: torch.Tensor
    exact: bool = False
    atol: float = 1e-5
    rtol: float = 1e-5
    diagnose: Diagnose | None = None


@dataclass
class CheckReport:
    """The outcome of one exercise check; its repr is the text shown to the learner."""

    exercise: str
    passed: bool
    n_cases: int
    failed_case: str | None = None
    problem: str | None = None
    hint: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        if self.passed:
            return f"✔ {self.exercise}: passed all {self.n_cases} checks."
        lines = [f"✘ {self.exercise}: not passed yet."]
        if self.failed_case:
            lines.append(f"  case:    {self.failed_case}")
        if self.problem:
            lines.append(f"  problem: {self.problem}")
        if self.hint:
            lines.append(f"  hint:    {self.hint}")
        return "\n".join(lines)

    __str__ = __repr__


def _describe_shape(x) -> str:
    return f"shape {tuple(x.shape)}, dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def _unfinished(err: BaseException) -> bool:
    """Whether `err` is, or wraps, the stub's NotImplementedError (Triton's interpreter wraps errors)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, NotImplementedError) or "NotImplementedError" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def call_learner(exercise: str, fn: Callable, args: tuple, case: str, n_cases: int) -> tuple[Any, CheckReport | None]:
    """Call the learner's function; a stub, a non-function or an exception becomes a report."""
    if not callable(fn):
        return None, CheckReport(
            exercise,
            False,
            n_cases,
            problem=f"expected a function, got {type(fn).__name__}",
            hint="pass the function itself, without calling it: check(my_fn), not check(my_fn())",
        )
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, CheckReport(
            exercise,
            False,
            n_cases,
            case,
            "not attempted yet",
            "replace the `raise NotImplementedError` line with your code, then run the cell again",
        )
    except Exception as err:  # the learner's bug, reported as text rather than a traceback
        if _unfinished(err):  # e.g. a stub inside a Triton kernel: the interpreter wraps the error
            return None, CheckReport(
                exercise,
                False,
                n_cases,
                case,
                "not attempted yet",
                "replace the `raise NotImplementedError` line with your code, then run the cell again",
            )
        return None, CheckReport(
            exercise,
            False,
            n_cases,
            case,
            f"your function raised {type(err).__name__}: {err}",
            "try it by hand on this case's inputs",
        )


def run_checks(
    exercise: str, fn: Callable, cases: list[Case], *, nan_hint: Callable[[Case], str] | None = None
) -> CheckReport:
    """Try `fn` on every case in order; report the first failure with the most specific hint."""
    for case in cases:
        fail = lambda problem, hint=None: CheckReport(exercise, False, len(cases), case.name, problem, hint)  # noqa: E731
        got, report = call_learner(exercise, fn, case.args, case.name, len(cases))
        if report is not None:
            return report
        if not isinstance(got, torch.Tensor):
            return fail(f"returned {type(got).__name__}, expected a torch.Tensor", "did you forget a `return`?")
        if got.shape != case.expected.shape:
            hint = case.diagnose(got) if case.diagnose else None
            return fail(f"returned {_describe_shape(got)}, expected shape {tuple(case.expected.shape)}", hint)
        if got.dtype != case.expected.dtype:
            hint = case.diagnose(got) if case.diagnose else None
            return fail(f"returned dtype {got.dtype}, expected {case.expected.dtype}", hint)
        if bool(torch.isnan(got).any()) and not bool(torch.isnan(case.expected).any()):
            hint = nan_hint(case) if nan_hint else (case.diagnose(got) if case.diagnose else None)
            return fail("the result contains NaN", hint)
        if case.exact:
            ok = torch.equal(got, case.expected)
        else:
            ok = torch.allclose(got, case.expected, atol=case.atol, rtol=case.rtol)
        if not ok:
            hint = case.diagnose(got) if case.diagnose else None
            diff = (got.double() - case.expected.double()).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
            finite = torch.isfinite(got) == torch.isfinite(case.expected)
            problem = (
                "wrong values"
                if not bool(finite.all())
                else f"wrong values (largest difference {diff.max().item():.3g})"
            )
            return fail(problem, hint)
    return CheckReport(exercise, True, len(cases))
