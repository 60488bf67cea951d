"""lib.doctor reports this machine and every lesson; the course map numbers the lessons in order."""

import io

import torch

from lib import doctor
from lib.course import LESSONS


def test_doctor_reports_this_machine_and_every_lesson():
    buf = io.StringIO()
    caps = doctor.report(file=buf)
    text = buf.getvalue()
    assert caps.torch == torch.__version__ and torch.__version__ in text
    assert caps.gpu == torch.cuda.is_available()
    assert ("none (CPU only)" in text) == (not torch.cuda.is_available())
    for lesson in LESSONS:
        assert f"{lesson.number:02d} {lesson.title}" in text
    expected_mode = "compiled" if torch.cuda.is_available() and caps.triton else ("interpreter" if caps.triton else "unavailable")
    assert caps.triton_mode == expected_mode
    from lib.kernels.scan_cpu import cpu_kernel_status
    assert caps.cpu_scan == cpu_kernel_status() and f"C scan loop (lesson 06): {caps.cpu_scan}" in text


def test_doctor_runs_as_a_module():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lib.doctor"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("One Mask capability check")


def test_course_map_numbers_lessons_in_order():
    assert [lesson.number for lesson in LESSONS] == list(range(1, 9))
    assert LESSONS[0].landed()
