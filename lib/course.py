"""The course map as data: one list that the doctor, the README check and the book share.

`landed` says whether the lesson's notebook exists yet; `cpu` and `gpu` say what it does on a
CPU-only laptop and what a CUDA GPU adds. Keep in step with ../shared/COURSE-MAP.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["LESSONS", "Lesson"]


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
        root = root or Path(__file__).resolve().parent.parent
        return (root / "lessons" / f"{self.stem}.ipynb").exists()


LESSONS: tuple[Lesson, ...] = (
    Lesson(1, "masking-equation", "One equation, one mask", "What separates BERT from GPT?",
           "runs fully", "nothing needed"),
    Lesson(2, "bert", "BERT", "What does a bidirectional encoder learn, and is ours the real thing?",
           "runs fully (small pretrained MiniLM)", "faster fine-tuning"),
    Lesson(3, "gpt", "GPT", "How does one causal pass train T predictions, and how do we sample?",
           "runs fully at toy scale", "larger training runs"),
    Lesson(4, "kv-cache", "KV-cache math", "What does generation cost in time and memory, and why page?",
           "runs fully (timings are CPU timings)", "GPU timings"),
    Lesson(5, "attention-kernels", "Attention kernels", "Why is naive attention slow, and what does a flash kernel do?",
           "Triton kernel under the interpreter, small sizes", "compiled Triton kernel and real speed-ups"),
    Lesson(6, "mamba", "Mamba", "How does a selective SSM compress a sequence into a fixed state?",
           "runs fully at toy scale", "long-sequence timings"),
    Lesson(7, "moe", "Mixture of Experts", "How do routers spread tokens, and what keeps them balanced?",
           "runs fully; expert parallelism across CPU processes (gloo)", "NCCL expert parallelism"),
    Lesson(8, "architectures-compared", "Architectures compared", "Which architecture for which job, measured?",
           "runs fully at toy scale", "larger runs"),
)
