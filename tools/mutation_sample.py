"""A fixed sample of plausible one-line bugs in lib, each run against its own module's tests.

    python tools/mutation_sample.py                    # this checkout, every mutant
    python tools/mutation_sample.py --repo DIR         # another checkout (a git worktree of an older commit)
    python tools/mutation_sample.py --only softmax-max --dry-run

For each mutant the file is changed in place (one exact snippet, found exactly once), its test
files run with `pytest -x`, and the file is restored, whatever happens. A mutant is *killed* when
the tests fail, *survives* when they pass. The same list, run on two commits, says whether the
suite catches at least as much as before. Paths are tried in order, so a mutant still applies
after its module moved (lib/claims.py became lib/course/claims.py). Run it on a quiet machine:
it takes several minutes. A maintainer's measure, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    id: str
    paths: tuple[str, ...]  # the file, where it lives now first
    old: str | tuple[str, ...]  # alternatives, tried in order, where the line changed between commits
    new: str | tuple[str, ...]
    tests: tuple[str, ...]  # the module's own test files


M = Mutant
MUTANTS = [
    M(
        "softmax-max",
        ("lib/attention.py",),
        "row_max = scores.amax(dim=dim, keepdim=True)",
        "row_max = scores.amin(dim=dim, keepdim=True)",
        ("tests/lib/test_attention.py",),
    ),
    M(
        "softmax-empty-row",
        ("lib/attention.py",),
        "torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)",
        "row_max",
        ("tests/lib/test_attention.py",),
    ),
    M(
        "kv-expand",
        ("lib/attention.py",),
        "x.repeat_interleave(groups, dim=1)",
        "x.repeat(1, groups, 1, 1)",
        ("tests/lib/test_attention.py",),
    ),
    M(
        "causal-offset",
        ("lib/masks.py",),
        "q_pos = torch.arange(S - seq_len, S, device=device)",
        "q_pos = torch.arange(0, seq_len, device=device)",
        ("tests/lib/test_masks.py",),
    ),
    M(
        "rope-rotate-sign",
        ("lib/rope.py",),
        "return torch.cat([-x2, x1], dim=-1)",
        "return torch.cat([x2, -x1], dim=-1)",
        ("tests/lib/test_rope.py",),
    ),
    M(
        "rope-frequencies",
        ("lib/rope.py",),
        "return base ** (-2.0 * i / D)",
        "return base ** (-1.0 * i / D)",
        ("tests/lib/test_rope.py",),
    ),
    M(
        "top-k-ties",
        ("lib/sampling.py",),
        "logits.masked_fill(logits < kth, NEG_INF)",
        "logits.masked_fill(logits <= kth, NEG_INF)",
        ("tests/lib/test_sampling.py",),
    ),
    M(
        "top-p-boundary",
        ("lib/sampling.py",),
        "keep = cum > 1.0 - p",
        "keep = cum >= 1.0 - p",
        ("tests/lib/test_sampling.py",),
    ),
    M(
        "kv-cache-length",
        ("lib/kv_cache.py",),
        "        self.length = end\n",
        "        self.length = end - 1\n",
        ("tests/lib/test_kv_cache.py",),
    ),
    M("decode-start", ("lib/decode.py",), "start=T + step,", "start=T + step + 1,", ("tests/lib/test_decode.py",)),
    M("mean-pool-divisor", ("lib/bert.py",), "w.sum(1).clamp_min(1e-9)", "w.shape[1]", ("tests/lib/test_bert.py",)),
    M(  # 20% random tokens and none left unchanged, where BERT leaves 10% (a wider [MASK] band is invisible:
        # the random band is written after it)
        "mlm-random-band",
        ("lib/bert.py",),
        "to_random = selected & (choice >= 0.8) & (choice < 0.9)",
        "to_random = selected & (choice >= 0.8)",
        ("tests/lib/test_bert.py",),
    ),
    M(
        "moe-renormalise",
        ("lib/moe.py",),
        "gates = gates / gates.sum(dim=-1, keepdim=True)",
        "gates = gates",
        ("tests/lib/test_moe.py",),
    ),
    M(
        "switch-loss-scale",
        ("lib/moe.py",),
        "return E * (f * P).sum()",
        "return (f * P).sum()",
        ("tests/lib/test_moe.py",),
    ),
    M(
        "lora-scaling",
        ("lib/lora.py",),
        "self.scaling = self.alpha / r",
        "self.scaling = r / self.alpha",
        ("tests/lib/test_lora.py",),
    ),
    M(
        "warmup-floor",
        ("lib/train.py",),
        "return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))",
        "return 0.5 * (1 + math.cos(math.pi * progress))",
        ("tests/lib/test_train.py",),
    ),
    M(
        "scan-readout",
        ("lib/scan.py",),
        "(h * c_t.unsqueeze(1)).sum(-1)",
        "(h * c_t.unsqueeze(1)).mean(-1)",
        ("tests/lib/test_scan.py",),
    ),
    # the reference scan's step: its own loop now, `recurrence` (which it called) before
    M(
        "scan-recurrence",
        ("lib/scan.py",),
        ("h = a_t * h + bx_t  # h_t", "h = a_t * h + bx_t  # (B, D, N)"),
        ("h = a_t * (h + bx_t)  # h_t", "h = a_t * (h + bx_t)  # (B, D, N)"),
        ("tests/lib/test_scan.py",),
    ),
    M(
        "mamba-inverse-softplus",
        ("lib/mamba.py",),
        "return y + torch.log(-torch.expm1(-y))",
        "return y + torch.log(torch.expm1(y))",
        ("tests/lib/test_mamba.py",),
    ),
    M(  # the recurrent step's convolution with its window reversed (nn.Conv1d's padding is never used)
        "mamba-step-conv",
        ("lib/mamba.py",),
        "xs = (window * self.conv1d.weight[:, 0]).sum(-1)",
        "xs = (window * self.conv1d.weight[:, 0].flip(-1)).sum(-1)",
        ("tests/lib/test_mamba.py",),
    ),
    M(
        "claims-reproduced",
        ("lib/course/claims.py", "lib/claims.py"),
        '"reproduced" if _condition("reproduced_if", holds) else otherwise',
        '"reproduced" if holds is not False else otherwise',
        ("tests/lib/test_claims.py",),
    ),
    M(
        "gpt-gelu",
        ("lib/gpt.py",),
        "F.gelu(self.c_fc(x), approximate=self.approximate)",
        "F.gelu(self.c_fc(x))",
        ("tests/lib/test_gpt.py",),
    ),
    M(
        "gpt-residual",
        ("lib/gpt.py",),
        "x = x + self.attn(self.ln_1(x),",
        "x = self.attn(self.ln_1(x),",
        ("tests/lib/test_gpt.py",),
    ),
    M(
        "llama-tied-head",
        ("lib/llama.py",),
        "def head_weight(self)",
        "def head_weight_(self)",
        ("tests/lib/test_llama.py",),
    ),
]


def apply(repo: Path, m: Mutant) -> tuple[Path, str, str] | None:
    """(the file, its text, the text with the mutant), or None where no snippet is found exactly once."""
    olds, news = (m.old, m.new) if isinstance(m.old, tuple) else ((m.old,), (m.new,))
    for rel in m.paths:
        path = repo / rel
        if not path.exists():
            continue
        text = path.read_text()
        for old, new in zip(olds, news):
            if text.count(old) == 1:
                return path, text, text.replace(old, new)
    return None


def run(repo: Path, m: Mutant, python: str, timeout: int) -> dict:
    found = apply(repo, m)
    if found is None:
        return {"id": m.id, "result": "not applicable"}
    path, original, mutated = found
    start = time.perf_counter()
    try:
        path.write_text(mutated)
        env = dict(os.environ, PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1")
        cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]  # one process: -x then exits 1
        try:
            done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
            result = (
                "survived" if done.returncode == 0 else "killed" if done.returncode == 1 else f"error {done.returncode}"
            )
        except subprocess.TimeoutExpired:
            result = "killed (timeout)"
    finally:
        path.write_text(original)
    return {
        "id": m.id,
        "file": str(path.relative_to(repo)),
        "result": result,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout to mutate (default: this one)")
    parser.add_argument("--only", nargs="*", help="mutant ids to run")
    parser.add_argument("--dry-run", action="store_true", help="only say which mutants apply")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only]
    results = []
    for m in chosen:
        if args.dry_run:
            found = apply(repo, m)
            results.append({"id": m.id, "result": "applies" if found else "not applicable"})
        else:
            results.append(run(repo, m, sys.executable, args.timeout))
        print(f"{results[-1]['id']:26} {results[-1]['result']}", flush=True)
    killed = sum(r["result"].startswith("killed") for r in results)
    print(f"{killed} of {len(results)} killed")
    if args.json:
        args.json.write_text(json.dumps({"repo": str(repo), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
