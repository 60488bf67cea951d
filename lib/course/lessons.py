"""The course map as data: one list that the doctor, the README check and the book share.

`landed` says whether the lesson's notebook exists yet; `cpu` and `gpu` say what it does on a
CPU-only laptop and what a CUDA GPU adds. Keep in step with ../shared/COURSE-MAP.md.

`measured()` reads what `make notebooks` recorded for each lesson (lessons/run_times.json: its
compute time on 2 cores and its kernel's peak resident memory); `class_needs` and
`sizing_markdown` turn that into what a server for a class needs (the teachers' page's sizing table is
generated from it, and the doctor warns where a server has less memory than a lesson used).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LESSONS",
    "Lesson",
    "READING_WPM",
    "build_minutes",
    "class_needs",
    "lessons_markdown",
    "measured",
    "sizing_markdown",
    "study_minutes",
]

ROOT = Path(__file__).resolve().parents[2]
HEADROOM = 1.25  # per-student memory: a lesson's measured peak plus a quarter (other data, other runs)
READING_WPM = 100  # words a minute for technical prose and code read with care: the study-time estimate
_EXERCISE = re.compile(r"^### Exercise [0-9.]+ .*?~(\d+) min\)", re.M)
_STEP = re.compile(r"^### Step [0-9.]+ .*?~(\d+) min\b", re.M)


@dataclass(frozen=True)
class Lesson:
    number: int
    slug: str
    title: str
    question: str
    cpu: str
    gpu: str

    @property
    def stem(self) -> str:
        return f"{self.number:02d}-{self.slug}"

    def landed(self, root: Path | None = None) -> bool:
        return ((root or ROOT) / "lessons" / f"{self.stem}.ipynb").exists()

    def build_track(self, root: Path | None = None) -> Path | None:
        """The source of this lesson's build track, lessons/build/NN-build-topic.md (None if absent);
        the student opens the .ipynb generated beside it."""
        found = sorted(((root or ROOT) / "lessons" / "build").glob(f"{self.number:02d}-build-*.md"))
        return found[0] if found else None


LESSONS: tuple[Lesson, ...] = (
    Lesson(
        1, "masking-equation", "One equation, one mask", "What separates BERT from GPT?", "runs fully", "nothing needed"
    ),
    Lesson(
        2,
        "bert",
        "BERT",
        "What does a bidirectional encoder learn, and is ours the real thing?",
        "runs fully (small pretrained MiniLM)",
        "faster fine-tuning",
    ),
    Lesson(
        3,
        "gpt",
        "GPT",
        "How does one causal pass train T predictions, and how do we sample?",
        "runs fully: toy training, and the real SmolLM2-135M for prediction",
        "larger training runs",
    ),
    Lesson(
        4,
        "kv-cache",
        "KV-cache math",
        "What does generation cost in time and memory, and why page?",
        "runs fully, SmolLM2-135M decoding included (timings are CPU timings)",
        "GPU timings",
    ),
    Lesson(
        5,
        "attention-kernels",
        "Attention kernels",
        "Why is naive attention slow, and what does a flash kernel do?",
        "Triton kernel under the interpreter, small sizes",
        "compiled Triton kernel and real speed-ups",
    ),
    Lesson(
        6,
        "mamba",
        "Mamba",
        "How does a selective SSM compress a sequence into a fixed state?",
        "runs fully at toy scale",
        "long-sequence timings",
    ),
    Lesson(
        7,
        "moe",
        "Mixture of Experts",
        "How do routers spread tokens, and what keeps them balanced?",
        "runs fully; expert parallelism across CPU processes (gloo)",
        "NCCL expert parallelism",
    ),
    Lesson(
        8,
        "architectures-compared",
        "Architectures compared",
        "Which architecture for which job, measured?",
        "runs fully at toy scale",
        "larger runs",
    ),
)


def measured(root: Path | None = None) -> dict[str, dict]:
    """Each lesson's recorded run ({stem: {"seconds", "peak_rss_mib", "machine", ...}}); empty
    where no record ships (a copy of lib without the lessons)."""
    path = (root or ROOT) / "lessons" / "run_times.json"
    try:
        return json.loads(path.read_text())["lessons"]
    except (OSError, ValueError, KeyError):
        return {}


def class_needs(n_students: int, root: Path | None = None) -> dict:
    """What a server for `n_students` running the lessons at once needs, from the recorded peaks:
    a per-student memory limit (the largest lesson peak with 25% headroom, rounded up to 256 MiB),
    the total for the class, and the cores for every lesson to keep its 2-core timing."""
    if isinstance(n_students, bool) or not isinstance(n_students, int) or n_students < 1:
        raise ValueError(f"n_students must be a whole number >= 1, got {n_students!r}")
    runs = measured(root)
    peaks = [r["peak_rss_mib"] for r in runs.values() if r.get("peak_rss_mib")]
    if not peaks:
        raise ValueError("no lesson has a recorded peak memory: run `make notebooks` first")
    per_student = 256 * math.ceil(max(peaks) * HEADROOM / 256)
    return {
        "per_student_mib": per_student,
        "total_gib": n_students * per_student / 1024,
        "cores": 2 * n_students,
        "largest_peak_mib": max(peaks),
        "slowest_seconds": max(r["seconds"] for r in runs.values()),
    }


def sizing_markdown(n_students: int = 30, root: Path | None = None) -> str:
    """The teachers' page's sizing section body (book/teaching.md): one row per lesson, then what a
    class needs."""
    runs = measured(root)
    rows = ["| lesson | compute on 2 cores | peak memory of its kernel |", "|---|---|---|"]
    for lesson in LESSONS:
        r = runs.get(lesson.stem)
        if r is not None:
            peak = "not measured" if r.get("peak_rss_mib") is None else f"{r['peak_rss_mib']:,} MiB"
            rows.append(f"| {lesson.number:02d} {lesson.title} | {r['seconds']:.0f} s | {peak} |")
    machines = sorted({r["machine"]["cpu"] for r in runs.values()})
    try:
        need = class_needs(n_students, root)
    except ValueError:  # no peak recorded yet
        return "\n".join(rows) + "\n\nNo peak memory is recorded yet: run `make notebooks`."
    return "\n".join(rows) + (
        f"\n\nMeasured by `make notebooks` on {', '.join(machines)} (2 threads). A class of "
        f"{n_students} working at the same time needs about {need['per_student_mib']:,} MiB per "
        f"student (the largest peak, {need['largest_peak_mib']:,} MiB, plus 25%), "
        f"{need['total_gib']:.1f} GiB in all, and {need['cores']} cores for every lesson to "
        f"keep these times (2 per student). JupyterLab's own server process comes on top of "
        f"each student's kernel."
    )


def study_minutes(lesson: Lesson, root: Path | None = None) -> int:
    """An estimate of a lesson's study time, computed from its source: every word of prose and
    code read at READING_WPM, plus the minutes each exercise's heading states, rounded up to a
    quarter of an hour (the compute time is on top: see `measured`)."""
    text = ((root or ROOT) / "lessons" / f"{lesson.stem}.md").read_text()
    exercises = sum(int(m) for m in _EXERCISE.findall(text))
    return 15 * math.ceil((len(text.split()) / READING_WPM + exercises) / 15)


def build_minutes(lesson: Lesson, root: Path | None = None) -> int | None:
    """The minutes a lesson's build track states, its steps' headings summed (None: no track)."""
    track = lesson.build_track(root)
    return None if track is None else sum(int(m) for m in _STEP.findall(track.read_text()))


def _duration(minutes: int) -> str:
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def lessons_markdown(root: Path | None = None) -> str:
    """The README's lesson table: each lesson, its exercise version and its build track (links),
    its question, its recorded compute time on 2 cores, its study time (`study_minutes`) and the
    build track's stated minutes (`build_minutes`)."""
    runs = measured(root)
    rows = [
        "| # | lesson | exercises | build it yourself | the question | compute on 2 cores | study time |",
        "|---|---|---|---|---|---|---|",
    ]
    for lesson in LESSONS:
        run = runs.get(lesson.stem)
        compute = f"{run['seconds']:.0f} s" if run else "not measured"
        track = lesson.build_track(root)
        build = (
            "not yet"
            if track is None
            else f"[{track.stem[3:].removeprefix('build-').replace('-', ' ')}](lessons/build/{track.stem}.ipynb), "
            f"{_duration(build_minutes(lesson, root))}"
        )
        rows.append(
            f"| {lesson.number:02d} | [{lesson.title}](lessons/{lesson.stem}.ipynb) | "
            f"[exercises](lessons/exercises/{lesson.stem}.ipynb) | {build} | {lesson.question} | {compute} | "
            f"{_duration(study_minutes(lesson, root))} |"
        )
    return "\n".join(rows) + (
        f"\n\nStudy time: every word of the lesson read at {READING_WPM} words a minute, plus the minutes its "
        f"exercises state; a build track's time is what its steps state, on top (generated from the lessons by "
        f"`tools/execute_lessons.py`, with their compute time)."
    )
