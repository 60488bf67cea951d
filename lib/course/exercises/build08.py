"""Checks for build track 08, "a hybrid from your own parts" (lessons/build/08-build-hybrid.md).

    student_parts(folder=".")     the learner's own parts, read from their saved build notebooks:
                                  MyDecoderBlock (03-build-gpt.ipynb), MyMambaMixer
                                  (06-build-mamba.ipynb) and MyMoE (07-build-moe.ipynb), each from
                                  its notebook's cells tagged `part` and checked by its own track's
                                  check; a missing, unfinished or failing part is replaced by a
                                  stand-in from lib with the same interface, and the loader says so
    lib_parts()                   the stand-ins alone: the parts Steps 8.2 and 8.3 are checked with
    HybridConfig                  the sizes of one hybrid; .llama() and .mamba() give the parts'
                                  configs

    check_residual_block(cls)     MyResidualBlock(d_model, mixer)(x) = x + mixer(RMSNorm(x))
    check_make_layer(fn)          fn(letter, cfg, parts) -> the layer one letter of a plan means
    check_hybrid(cls)             MyHybrid(cfg, plan, parts)(idx (B, T)) -> logits (B, T, V),
                                  equal to a reference stack from lib's parts holding the
                                  learner's weights
    check_recall_training(fn)     fn(plan, steps, seed) -> (model, losses): the learner's hybrid
                                  trained on lesson 08's associative recall; the loss must fall,
                                  and the accuracy is reported against chance

A plan is a string, one letter per layer: "A" a decoder block (attention and SwiGLU, with its own
norms and residuals), "M" a Mamba mixer in a pre-norm residual block, "E" an MoE feed-forward in a
pre-norm residual block (Jamba, Lieber et al. 2024, interleaves all three). Lesson 08's hybrid is
"MMA".

Glossary: B batch, T tokens, C width, V vocabulary, E experts, K experts per token, N SSM state.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib.course.bench import torch_threads
from lib.course.compare import Recipe
from lib.course.exercises import CheckReport, call_learner
from lib.course.exercises.build07 import EARLIER_STEP_HINT, guard_earlier_steps
from lib.llama import LlamaBlock, LlamaConfig
from lib.mamba import MambaConfig, MambaMixer
from lib.moe import MoE
from lib.rope import rope_cos_sin
from lib.tasks import IGNORE, AssociativeRecall, task_accuracy, task_loss

__all__ = ["check_hybrid", "check_make_layer", "check_recall_training", "check_residual_block"]

PART_TAG = "part"
EPS = 1e-5  # every RMSNorm here: Llama's and Mamba's eps
# fp64 for Steps 8.1-8.3: the reference runs the very modules the learner's stack holds, so the two
# differ only by the order of a few additions (~1e-15); every mistake named here moves the
# logits by 1e-6 (the norm's eps) or far more
TOL64 = dict(atol=1e-9, rtol=1e-9)
# fp32 for the learner's own parts (Step 8.4): one block's output is O(1) and its few sums agree
# to ~1e-7 in any order
TOL32 = dict(atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- sizes and parts
@dataclass(frozen=True)
class HybridConfig:
    """The sizes of one hybrid: width, the decoder block's heads and SwiGLU width, the Mamba
    state, the MoE's experts. `llama()` and `mamba()` are the configs the parts take."""

    vocab_size: int = 34  # V: AssociativeRecall(n_keys=16, n_values=16).vocab_size
    d_model: int = 32  # C
    n_head: int = 4  # H
    n_kv_head: int = 2  # H_kv
    d_ff: int = 64  # the decoder block's SwiGLU hidden width
    d_state: int = 16  # N
    num_experts: int = 4  # E
    top_k: int = 2  # K
    expert_d_ff: int = 32  # one expert's SwiGLU hidden width
    block_size: int = 64  # the longest sequence the decoder blocks' RoPE tables cover

    def llama(self) -> LlamaConfig:
        """The config of one decoder block ("A")."""
        return LlamaConfig(
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            n_layer=1,
            n_head=self.n_head,
            n_kv_head=self.n_kv_head,
            n_embd=self.d_model,
            intermediate_size=self.d_ff,
            rope_base=10000.0,
        )

    def mamba(self) -> MambaConfig:
        """The config of one Mamba mixer ("M")."""
        return MambaConfig(vocab_size=self.vocab_size, d_model=self.d_model, n_layers=1, d_state=self.d_state)


class LibDecoderBlock(LlamaBlock):
    """lib.llama.LlamaBlock that makes its own RoPE tables: forward(x (B, T, C)) at positions
    0..T-1, the interface of track 03's MyDecoderBlock(cfg)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg)
        cos, sin = rope_cos_sin(cfg.block_size, cfg.head_dim, base=cfg.rope_base, layout=cfg.rope_layout)
        self.register_buffer("rope_cos", cos, persistent=False)  # (T_max, D)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        rope = (self.rope_cos[:T].to(x.dtype), self.rope_sin[:T].to(x.dtype))  # (T, D) each
        return super().forward(x, rope=rope)


class LibMoE(MoE):
    """lib.moe.MoE as Mixtral computes it (SwiGLU experts, softmax over all E, top-K,
    renormalised), with track 07's interface MyMoE(d_model, d_ff, num_experts, top_k)."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int):
        super().__init__(d_model, d_ff, num_experts, top_k, activation="swiglu", gating="softmax_topk")


@dataclass
class Parts:
    """The three parts a plan's letters stand for, and where each came from."""

    DecoderBlock: type  # "A": DecoderBlock(cfg.llama())(x) -> x, a whole pre-norm block
    MambaMixer: type  # "M": MambaMixer(cfg.mamba())(x) -> y, the mixer alone
    MoE: type  # "E": MoE(d_model, d_ff, num_experts, top_k)(x) -> (y, router_logits)
    origin: dict[str, str] = field(default_factory=dict)  # letter -> where the part came from

    def __repr__(self) -> str:
        lines = ["Parts for the hybrid:"]
        for letter, attr in (("A", "DecoderBlock"), ("M", "MambaMixer"), ("E", "MoE")):
            cls = getattr(self, attr).__name__
            lines.append(f"  {letter}  {attr:12s} {cls:16s} {self.origin.get(letter, '')}")
        return "\n".join(lines)


@dataclass(frozen=True)
class PartSpec:
    letter: str
    what: str
    notebook: str
    class_name: str
    check: tuple[str, str]  # (module, function) of the track's check
    stand_in: type
    stand_in_name: str


PART_SPECS = (
    PartSpec(
        "A",
        "decoder block",
        "03-build-gpt.ipynb",
        "MyDecoderBlock",
        ("lib.course.exercises.build03", "check_decoder_block"),
        LibDecoderBlock,
        "lib.llama.LlamaBlock",
    ),
    PartSpec(
        "M",
        "Mamba mixer",
        "06-build-mamba.ipynb",
        "MyMambaMixer",
        ("lib.course.exercises.build06", "check_mamba_mixer"),
        MambaMixer,
        "lib.mamba.MambaMixer",
    ),
    PartSpec(
        "E",
        "MoE layer",
        "07-build-moe.ipynb",
        "MyMoE",
        ("lib.course.exercises.build07", "check_moe_layer"),
        LibMoE,
        "lib.moe.MoE (Mixtral's gating, SwiGLU experts)",
    ),
)


def lib_parts() -> Parts:
    """The stand-ins from lib: what the checks of Steps 8.2 and 8.3 build with."""
    return Parts(LibDecoderBlock, MambaMixer, LibMoE, {s.letter: f"stand-in: {s.stand_in_name}" for s in PART_SPECS})


# --------------------------------------------------------------------------- the loader
def _part_source(source: str) -> str:
    """A part cell's code without its closing check call and without IPython's % and ! lines."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n")]
    drop = set()
    for node in ast.parse("\n".join(lines)).body:
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id.startswith("check_")
        ):
            drop.update(range(node.lineno - 1, node.end_lineno))
    return "\n".join(line for i, line in enumerate(lines) if i not in drop)


def _find_notebook(folder: Path, spec: PartSpec) -> Path | None:
    path = folder / spec.notebook
    if path.exists():
        return path
    others = sorted(folder.glob(f"{spec.notebook[:2]}-build-*.ipynb"))
    return others[0] if others else None


def _load_part(folder: Path, spec: PartSpec) -> tuple[type | None, str]:
    """(the learner's class, where it came from) when its notebook defines it and it passes its
    check; else (None, why not)."""
    path = _find_notebook(folder, spec)
    if path is None:
        return None, (f"no {spec.notebook} in {folder.resolve()}: save build track {spec.notebook[:2]} there")
    try:
        nb = json.loads(path.read_text())
        cells = [
            c for c in nb["cells"] if c.get("cell_type") == "code" and PART_TAG in c.get("metadata", {}).get("tags", [])
        ]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{path.name} could not be read as a notebook ({type(err).__name__}: {err})"
    if not cells:
        return None, f"{path.name} has no code cell tagged {PART_TAG!r}"
    namespace = {"__name__": f"build_part_{path.stem.replace('-', '_')}"}
    out = io.StringIO()  # what the part cells print stays out of this notebook
    for i, cell in enumerate(cells):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        try:
            code = compile(_part_source(source), f"{path.name}, part cell {i + 1}", "exec")
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                exec(code, namespace)  # noqa: S102 - the learner's notebook, as their kernel would
        except NotImplementedError:
            return None, (f"{path.name}: a part cell is not finished yet (it raised NotImplementedError)")
        except Exception as err:  # the learner's code, reported as text
            return None, (f"running {path.name}'s part cell {i + 1} raised {type(err).__name__}: {err}")
    cls = namespace.get(spec.class_name)
    if cls is None:
        return None, f"{path.name}'s part cells define no {spec.class_name}"
    try:
        check = getattr(importlib.import_module(spec.check[0]), spec.check[1])
    except (ImportError, AttributeError) as err:
        return None, (f"{spec.check[0]}.{spec.check[1]} is not available to check your {spec.class_name} ({err})")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            report = check(cls)
    except Exception as err:  # a check should never raise; if it does, the part is not trusted
        return None, f"checking your {spec.class_name} raised {type(err).__name__}: {err}"
    where = f"your {spec.class_name} ({path.name})"
    if not getattr(report, "passed", False):
        if getattr(report, "problem", None) == "not attempted yet":
            return None, f"{where} is not finished yet ({report.exercise}: not attempted yet)"
        text = "\n".join("      " + line for line in repr(report).split("\n"))
        return None, f"{where} does not pass its check yet:\n{text}"
    return cls, f"yours: {spec.class_name} from {path.name} (its check passed)"


def student_parts(folder: str | Path = ".", *, quiet: bool = False) -> Parts:
    """The learner's MyDecoderBlock, MyMambaMixer and MyMoE from the build notebooks in `folder`
    (03-build-gpt.ipynb, 06-build-mamba.ipynb, 07-build-moe.ipynb): each notebook's cells tagged
    `part` run in a namespace of their own (their check calls left out), and the class is kept if
    its track's check passes. Otherwise lib's stand-in takes its place, and the summary printed
    (unless quiet) says which part, which notebook, and the check's report."""
    folder = Path(folder)
    chosen, origin = {}, {}
    for spec in PART_SPECS:
        with torch_threads(1):  # the parts' checks run small matrices: one thread is faster
            cls, why = _load_part(folder, spec)
        if cls is None:
            chosen[spec.letter] = spec.stand_in
            origin[spec.letter] = f"stand-in: {spec.stand_in_name}, because {why}"
        else:
            chosen[spec.letter], origin[spec.letter] = cls, why
    parts = Parts(chosen["A"], chosen["M"], chosen["E"], origin)
    if not quiet:
        print(parts)
    return parts


# --------------------------------------------------------------------------- shared helpers
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seeded(seed: int, make):
    """make() with torch's global generator seeded, the caller's generator left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def _close(a, b, **tol) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and bool(torch.allclose(a.double(), b.double(), **(tol or TOL64)))
    )


def _first(out):
    """A mixer's output: an MoE returns (y, router_logits), keep y."""
    return out[0] if isinstance(out, tuple) else out


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None = EPS) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _randomise_norms(module: nn.Module, seed: int) -> None:
    """Every RMSNorm/LayerNorm weight drawn around 1: a norm whose weight is skipped then shows."""
    g = _gen(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.RMSNorm, nn.LayerNorm)) and m.weight is not None:
                noise = torch.randn(m.weight.shape, generator=g, dtype=m.weight.dtype)
                m.weight.copy_(1 + 0.3 * noise)


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


LETTERS = {"A": "decoder block", "M": "Mamba-mixer block", "E": "MoE block"}


def _kind(layer, parts: Parts) -> str | None:
    """Which letter a layer is, given the parts it was built from ("bare M": an unwrapped mixer)."""
    if isinstance(layer, parts.DecoderBlock):
        return "A"
    mixer = getattr(layer, "mixer", None)
    if isinstance(mixer, parts.MambaMixer):
        return "M"
    if isinstance(mixer, parts.MoE):
        return "E"
    if isinstance(layer, parts.MambaMixer):
        return "bare M"
    if isinstance(layer, parts.MoE):
        return "bare E"
    return None


def _shared(layers) -> tuple[int, int] | None:
    """The first two layers that are one module or share a parameter tensor."""
    seen: dict[int, int] = {}
    for i, layer in enumerate(layers):
        ptrs = {id(layer)} | {id(p) for p in layer.parameters()}
        for ptr in ptrs:
            if ptr in seen and seen[ptr] != i:
                return seen[ptr], i
        seen.update({ptr: i for ptr in ptrs})
    return None


def _learner(name: str, obj, args: tuple, case: str, n: int):
    """call_learner on the learner's function, class or module, the caller's random state kept."""
    with torch.random.fork_rng(devices=[]):
        got, report = call_learner(name, guard_earlier_steps(obj), args, case, n)
    if report is not None and (report.problem or "").startswith("your function raised EarlierStep"):
        report.hint = EARLIER_STEP_HINT
    return got, report


SHARED_HINT = (
    "build a new module for every letter: `[layer] * n`, or one mixer wrapped twice, "
    "puts the same weights at several depths"
)


# --------------------------------------------------------------------------- 8.1 residual block
def _residual_variants(x, mixer, w):
    C = x.shape[-1]
    m = lambda h: _first(mixer(h))  # noqa: E731
    return [
        (
            lambda: m(_rms(x, w)),
            "the residual is missing: return x + mixer(norm(x)); without it "
            "a deep stack loses its input, and its gradient has no direct "
            "path down",
        ),
        (
            lambda: _rms(x + m(x), w),
            "that is post-norm, norm(x + mixer(x)): normalise the "
            "mixer's input instead, x + mixer(norm(x)) (pre-norm, as "
            "Llama and Mamba)",
        ),
        (lambda: x + _rms(m(x), w), "the norm goes before the mixer, on its input: x + mixer(norm(x))"),
        (lambda: x + m(x), "the norm is missing: x + mixer(norm(x))"),
        (
            lambda: _rms(x, w) + m(_rms(x, w)),
            "add the mixer's output to x itself, not to norm(x): the residual stream carries x unchanged",
        ),
        (
            lambda: x + m(F.layer_norm(x, (C,), w, None, EPS)),
            "RMSNorm, not LayerNorm: divide by the root mean square, with no mean subtracted and no bias",
        ),
        (
            lambda: x + m(_rms(x, w, None)),
            "RMSNorm's eps is 1e-5 here (Llama's and Mamba's), not "
            "nn.RMSNorm's default (the dtype's machine epsilon): "
            "nn.RMSNorm(d_model, eps=1e-5)",
        ),
        (
            lambda: x + m(_rms(x, None)),
            "the norm's learned weight is not applied: nn.RMSNorm(d_model, eps=1e-5) holds it and multiplies by it",
        ),
    ]


def check_residual_block(cls) -> CheckReport:
    """MyResidualBlock(d_model, mixer) with attributes `norm` (an RMSNorm with a (C,) weight, eps
    1e-5) and `mixer` (the module given); forward(x (B, T, C)) = x + mixer(norm(x)), keeping y
    when the mixer returns (y, router_logits)."""
    name = "Step 8.1 (the residual block)"
    mamba = MambaConfig(vocab_size=8, d_model=16, n_layers=1, d_state=4)
    specs = [
        ("a plain linear mixer, B=2, T=5, C=8", 8, (2, 5), lambda: nn.Linear(8, 8)),
        ("lib's Mamba mixer, B=2, T=7, C=16", 16, (2, 7), lambda: MambaMixer(mamba)),
        ("lib's MoE, which returns (y, router_logits): B=1, T=3, C=16", 16, (1, 3), lambda: LibMoE(16, 24, 4, 2)),
        ("one token (T=1), lib's Mamba mixer", 16, (1, 1), lambda: MambaMixer(mamba)),
    ]
    n = len(specs)
    for i, (case, C, (B, T), make) in enumerate(specs):
        mixer = _seeded(50 + i, make).double()
        x = torch.randn(B, T, C, generator=_gen(60 + i), dtype=torch.float64)
        fail = lambda problem, hint=None, case=case: CheckReport(  # noqa: E731
            name, False, n, case, problem, hint
        )
        block, report = _learner(name, cls, (C, mixer), case, n)
        if report is not None:
            return report
        if not isinstance(block, nn.Module):
            return fail(
                f"MyResidualBlock(...) gave {type(block).__name__}, expected an nn.Module",
                "class MyResidualBlock(nn.Module): call super().__init__() first",
            )
        missing = [a for a in ("norm", "mixer") if not isinstance(getattr(block, a, None), nn.Module)]
        if missing:
            return fail(
                f"no module attribute {' or '.join(repr(a) for a in missing)}",
                "name them self.norm and self.mixer: Steps 8.2-8.4 and their checks read them",
            )
        if block.mixer is not mixer:
            return fail(
                "self.mixer is not the mixer you were given",
                "store the module passed "
                "in, self.mixer = mixer (not a copy or a new one): its weights are the "
                "ones being trained",
            )
        weight = getattr(block.norm, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.shape != (C,):
            return fail("the norm has no learned weight of shape (C,)", "self.norm = nn.RMSNorm(d_model, eps=1e-5)")
        block.double()
        _randomise_norms(block.norm, 70 + i)
        w = block.norm.weight.detach()
        with torch.no_grad():
            got, report = _learner(name, block, (x.clone(),), case, n)
            if report is not None:
                if isinstance(mixer, MoE) and report.problem != "not attempted yet":
                    report.hint = (
                        "an MoE mixer returns a tuple (y, router_logits): add only y "
                        "to x, e.g. `h = self.mixer(self.norm(x)); h = h[0] if "
                        "isinstance(h, tuple) else h`"
                    )
                return report
            if isinstance(got, tuple):
                return fail(
                    "forward returned a tuple",
                    "return one tensor, x + mixer(norm(x)); of an MoE mixer's (y, router_logits), keep y",
                )
            expected = x + _first(mixer(_rms(x, w)))
            if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
                what = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                return fail(f"returned {what}, expected shape {tuple(expected.shape)}", "did you forget a `return`?")
            if not _close(got, expected):
                hint = next(
                    (h for v, h in _residual_variants(x, mixer, w) if _close(got, v())),
                    "forward(x) = x + mixer(norm(x)), norm = nn.RMSNorm(d_model, eps=1e-5)",
                )
                largest = (got - expected).abs().max().item()
                return fail(f"wrong values (largest difference {largest:.3g})", hint)
    return CheckReport(name, True, n)


# --------------------------------------------------------------------------- 8.2 layer per letter
SMALL = HybridConfig(
    vocab_size=20,
    d_model=16,
    n_head=4,
    n_kv_head=2,
    d_ff=24,
    d_state=4,
    num_experts=4,
    top_k=2,
    expert_d_ff=12,
    block_size=32,
)
LETTER_MAP = (
    "A -> parts.DecoderBlock(cfg.llama()); M -> MyResidualBlock(cfg.d_model, "
    "parts.MambaMixer(cfg.mamba())); E -> MyResidualBlock(cfg.d_model, "
    "parts.MoE(cfg.d_model, cfg.expert_d_ff, cfg.num_experts, cfg.top_k))"
)


def _reference_layer(letter: str, cfg: HybridConfig, parts: Parts) -> nn.Module:
    """lib's layer for a letter (for M and E a plain container: norm + mixer), to count its
    parameters."""
    if letter == "A":
        return parts.DecoderBlock(cfg.llama())
    box = nn.Module()
    box.norm = nn.RMSNorm(cfg.d_model, eps=EPS)
    box.mixer = (
        parts.MambaMixer(cfg.mamba())
        if letter == "M"
        else parts.MoE(cfg.d_model, cfg.expert_d_ff, cfg.num_experts, cfg.top_k)
    )
    return box


def _layer_kind_problem(layer, letter: str, cfg: HybridConfig, parts: Parts):
    """(problem, hint) when `layer` is not of the kind and size `letter` stands for, else None."""
    if not isinstance(layer, nn.Module):
        return f"gave {type(layer).__name__}, expected an nn.Module", "return the layer (a module)"
    kind = _kind(layer, parts)
    if kind == f"bare {letter}":
        return (
            f"{letter!r} gave the bare {'Mamba mixer' if letter == 'M' else 'MoE'}",
            "wrap it in your MyResidualBlock(cfg.d_model, mixer) (Step 8.1): the norm before "
            "it and the residual around it",
        )
    if kind != letter:
        what = "a " + LETTERS[kind] if kind in LETTERS else "a module of no part's kind"
        return (f"{letter!r} gave {what} ({type(layer).__name__})", f"letters map to parts: {LETTER_MAP}")
    ref = _seeded(0, lambda: _reference_layer(letter, cfg, parts))
    if _n_params(layer) != _n_params(ref):
        return (
            f"the {LETTERS[letter]} has {_n_params(layer):,} parameters, expected {_n_params(ref):,} for these sizes",
            f"build each part from cfg: {LETTER_MAP}",
        )
    return None


def _layer_problem(
    name: str, n: int, case: str, layer, letter: str, cfg: HybridConfig, parts: Parts, x: torch.Tensor
) -> CheckReport | None:
    """A report when `layer` is not the layer `letter` stands for, else None."""
    problem = _layer_kind_problem(layer, letter, cfg, parts)
    if problem:
        return CheckReport(name, False, n, case, *problem)
    with torch.no_grad():
        got, report = _learner(name, layer, (x,), case, n)
        if report is not None:
            if report.problem == "not attempted yet":
                report.problem = "the layer's forward is not written yet"
                report.hint = "finish Step 8.1 (MyResidualBlock) first"
            return report
        if isinstance(got, tuple) or not isinstance(got, torch.Tensor) or got.shape != x.shape:
            what = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return CheckReport(
                name,
                False,
                n,
                case,
                f"the layer's output is {what}, expected a tensor {tuple(x.shape)}",
                "fix Step 8.1 first: a block returns one tensor like x",
            )
        if letter != "A":
            expected = x + _first(layer.mixer(_rms(x, layer.norm.weight)))
            if not _close(got, expected, **TOL32):
                return CheckReport(
                    name,
                    False,
                    n,
                    case,
                    "the block is not x + mixer(norm(x))",
                    "fix Step 8.1 (MyResidualBlock) first: its check names the mistake",
                )
    return None


def check_make_layer(fn) -> CheckReport:
    """fn(letter, cfg, parts) -> a new layer: "A" parts.DecoderBlock(cfg.llama()), "M" and "E" your
    MyResidualBlock around parts.MambaMixer(cfg.mamba()) or parts.MoE(C, expert_d_ff, E, K); an
    unknown letter raises."""
    name = "Step 8.2 (a layer for each letter)"
    parts, cfg = lib_parts(), SMALL
    cases = ["M", "A", "E", "Q"]
    n = len(cases) + 1
    x = torch.randn(2, 5, cfg.d_model, generator=_gen(80))
    for letter in cases:
        case = f"letter {letter!r}" if letter != "Q" else "an unknown letter, 'Q'"
        layer, report = _learner(name, fn, (letter, cfg, parts), case, n)
        if letter == "Q":
            if report is None:
                return CheckReport(
                    name,
                    False,
                    n,
                    case,
                    f"'Q' gave {type(layer).__name__} instead of an error",
                    "an unknown letter must raise an error "
                    "naming it (raise ValueError(...)): a silent default builds a "
                    "model other than the plan says",
                )
            if report.problem == "not attempted yet":
                return report
            continue
        if report is not None:
            return report
        report = _layer_problem(name, n, case, layer, letter, cfg, parts, x)
        if report is not None:
            return report
        if letter == "M":  # a second call must give a second layer
            twice = "calling it twice with 'M'"
            again, report = _learner(name, fn, (letter, cfg, parts), twice, n)
            if report is not None:
                return report
            if _shared([layer, again]):
                return CheckReport(name, False, n, twice, "the same module came back twice", SHARED_HINT)
    return CheckReport(name, True, n)


# --------------------------------------------------------------------------- 8.3 the stack
STACK_NAMES = (
    "embed (nn.Embedding(V, C)), layers (nn.ModuleList), norm (nn.RMSNorm(C, "
    "eps=1e-5)), head (nn.Linear(C, V, bias=False))"
)


def _stack_parts(model) -> str | None:
    """A problem text when the model lacks the attributes Step 8.3 names."""
    wanted = {"embed": nn.Embedding, "layers": nn.ModuleList, "norm": nn.Module, "head": nn.Module}
    missing = [k for k, t in wanted.items() if not isinstance(getattr(model, k, None), t)]
    if missing:
        return f"MyHybrid has no {', '.join(missing)}: expected {STACK_NAMES}"
    weights = (getattr(model.norm, "weight", None), getattr(model.head, "weight", None))
    if not all(isinstance(w, torch.Tensor) for w in weights):
        return f"the norm and the head need a weight each: expected {STACK_NAMES}"
    return None


def _reference_logits(
    model, plan: str, idx: torch.Tensor, *, final_norm=True, order=None, tied=False, layer_norm=False
) -> torch.Tensor:
    """lib's stack on the learner's weights: embedding, each layer (a decoder block as it is; a
    residual block rebuilt around its mixer), the final RMSNorm, the head. Keywords give the wrong
    stacks the check recognises."""
    x = F.embedding(idx, model.embed.weight)  # (B, T) -> (B, T, C)
    layers = list(model.layers)
    for i in order or range(len(layers)):
        layer = layers[i]
        if plan[i] == "A":
            x = layer(x)
        else:
            x = x + _first(layer.mixer(_rms(x, layer.norm.weight)))
    w = model.norm.weight
    if final_norm:
        x = F.layer_norm(x, (x.shape[-1],), w, None, EPS) if layer_norm else _rms(x, w)
    head = model.embed.weight if tied else model.head.weight  # (V, C)
    return x @ head.T  # (B, T, C) @ (C, V) -> (B, T, V)


def _leaks(model, idx: torch.Tensor, tol: float) -> bool | None:
    """Whether changing the last token changes an earlier position's logits (None: it raised)."""
    if idx.shape[1] < 2:
        return False
    other = idx.clone()
    other[:, -1] = (idx[:, -1] + 1) % model.embed.num_embeddings
    try:
        with torch.no_grad():
            a, b = _first(model(idx)), _first(model(other))
    except Exception:  # the learner's model: its failure is reported elsewhere
        return None
    return not bool(torch.allclose(a[:, :-1], b[:, :-1], atol=tol, rtol=0))


def _plan_problem(model, plan: str, parts: Parts):
    layers = list(model.layers)
    if len(layers) != len(plan):
        return (
            f"{len(layers)} layers for the plan {plan!r} of {len(plan)} letters",
            "one layer per letter of the plan, in order: [my_make_layer(letter, cfg, parts) for letter in plan]",
        )
    pair = _shared(layers)
    if pair:
        return (f"layers {pair[0]} and {pair[1]} share their weights (the same module or mixer)", SHARED_HINT)
    kinds = [_kind(layer, parts) for layer in layers]
    if kinds != list(plan):
        i = next(i for i, (k, p) in enumerate(zip(kinds, plan)) if k != p)
        ignored = "".join(k or "?" for k in kinds) in ("MMA", "M" * len(plan), "A" * len(plan))
        hint = (
            "the plan string is ignored: build the layers from the plan you are given"
            if ignored
            else f"layer i is the letter plan[i]'s (Step 8.2: {LETTER_MAP})"
        )
        what = "a " + LETTERS[kinds[i]] if kinds[i] in LETTERS else "a module of no part's kind"
        return f"layer {i} is {what}, where the plan {plan!r} says {plan[i]}", hint
    return None


def _plan_table(model, plan: str) -> str:
    lines = [f"Layer plan {plan!r} ({_n_params(model):,} parameters):"]
    for i, (letter, layer) in enumerate(zip(plan, model.layers)):
        mixer = getattr(layer, "mixer", None)
        what = type(layer).__name__ + (f"({type(mixer).__name__})" if mixer is not None else "")
        lines.append(f"  layer {i}  {letter}  {what:34s} {_n_params(layer):>7,} parameters")
    return "\n".join(lines)


def _stack_hint(model, plan: str, idx: torch.Tensor, got: torch.Tensor, expected: torch.Tensor):
    variants = [
        (dict(final_norm=False), "the final norm is missing: logits = head(norm(x)) after the last layer"),
        (dict(layer_norm=True), "the final norm is RMSNorm (eps 1e-5), not LayerNorm"),
        (
            dict(order=list(range(len(plan)))[::-1]),
            "the layers run in reverse: layer 0 (the plan's first letter) reads the embeddings",
        ),
        (dict(tied=True), "use your own head (self.head), not the embedding matrix: this stack's head is untied"),
    ]
    for kw, hint in variants:
        if _close(got, _reference_logits(model, plan, idx, **kw)):
            return hint
    if _close(got, torch.softmax(expected, -1)):
        return "return the logits, not probabilities (no softmax)"
    if _leaks(model, idx, 1e-9) is True:
        return (
            "a future token changes the logits at earlier positions (a causal leak): nothing "
            "in the stack may mix positions except the layers themselves; a norm runs over C "
            "alone"
        )
    return "forward: x = embed(idx); x = layer(x) for each layer in order; logits = head(norm(x))"


def check_hybrid(cls) -> CheckReport:
    """MyHybrid(cfg, plan, parts) with embed, layers, norm and head; forward(idx (B, T)) -> logits
    (B, T, V), equal to a reference stack from lib's parts holding the same weights; causal; one
    layer per letter, none shared. Prints the layer plan when it passes."""
    name = "Step 8.3 (the hybrid stack)"
    parts, cfg = lib_parts(), SMALL
    specs = [
        ("plan 'MMA' (lesson 08's hybrid), B=2, T=6", "MMA", 2, 6),
        ("plan 'AEM', one token", "AEM", 1, 1),
        ("plan 'MAEM', B=2, T=9", "MAEM", 2, 9),
    ]
    n = len(specs)
    model = None
    for i, (case, plan, B, T) in enumerate(specs):
        fail = lambda problem, hint=None, case=case: CheckReport(  # noqa: E731
            name, False, n, case, problem, hint
        )
        model, report = _learner(name, cls, (cfg, plan, parts), case, n)
        if report is not None:
            return report
        if not isinstance(model, nn.Module):
            return fail(
                f"MyHybrid(...) gave {type(model).__name__}, expected an nn.Module",
                "class MyHybrid(nn.Module): call super().__init__() first",
            )
        problem = _stack_parts(model)
        if problem:
            return fail(problem, "name the parts as listed: the checks, and Step 8.4's, read them")
        problem = _plan_problem(model, plan, parts)
        if problem:
            return fail(*problem)
        model.double()
        _randomise_norms(model, 90 + i)
        idx = torch.randint(0, cfg.vocab_size, (B, T), generator=_gen(95 + i))
        with torch.no_grad():
            got, report = _learner(name, model, (idx,), case, n)
            if report is not None:
                return report
            if isinstance(got, tuple):
                return fail(
                    "forward returned a tuple",
                    "return the logits alone, (B, T, V); if an "
                    "MoE block's router logits come back too, fix Step 8.1 (the block "
                    "keeps only y)",
                )
            expected = _reference_logits(model, plan, idx)
            if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
                what = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                return fail(
                    f"returned {what}, expected logits {tuple(expected.shape)}",
                    "embed -> layers -> norm -> head, logits at every position",
                )
            if not _close(got, expected):
                largest = (got - expected).abs().max().item()
                return fail(
                    f"logits differ from the reference stack (largest difference {largest:.3g})",
                    _stack_hint(model, plan, idx, got, expected),
                )
    print(_plan_table(model, specs[-1][1]))
    return CheckReport(name, True, n)


# --------------------------------------------------------------------------- 8.4 training
RECALL_CONFIG = HybridConfig()
# lesson 08's multi-query associative recall with 4 pairs, every pair queried (lib.course.compare's
# recall_task of the default setting): sequences of 13 tokens, 34 token ids
RECALL_TASK = AssociativeRecall(n_pairs=4, n_queries=4, n_keys=16, n_values=16)
# lesson 08's recipe for the models with Mamba layers (lr 5e-3, batches of 16, AdamW's betas 0.9
# and 0.999), cut to 300 steps: on a 2-core CPU lib's parts learn 4-pair recall in that many
# (measured: ~1.5 s on one thread; seeds 0-3 reached 98-99.6% held-out accuracy)
RECALL_RECIPE = Recipe(steps=300, batch_size=16, lr=5e-3)
TRAIN_PLAN = "MMA"  # lesson 08's hybrid
# At the first step the model answers near uniformly over V = 34 ids: ln 34 = 3.53 nats. Learning
# only that answers are values (16 of them) is worth ln 34 - ln 16 = 0.75 nats; answering with one
# of the 4 values in the context (the plateau before recall) ln 16 - ln 4 = 1.39 more. A model
# whose weights never move stays at its first loss (batch to batch noise: ~0.1 nats); requiring a
# drop of 0.5 nats asks for most of the first lesson, and nothing about recall.
LOSS_MARGIN = 0.5
# a fresh-batch loss this far above the last training losses means the model memorised its batches
LOSS_HINT_GAP = 0.5


def _signature(layer) -> tuple:
    return type(layer), type(getattr(layer, "mixer", None))


def _trained_model_problem(model, plan: str, step_hint: str):
    """(problem, hint) about the structure of the learner's returned model, else None. The parts
    are the learner's: layers are told apart by their classes, not by lib's."""
    if not isinstance(model, nn.Module):
        return (f"returned {type(model).__name__} as the model, expected your MyHybrid", "return (model, losses)")
    problem = _stack_parts(model)
    if problem:
        return problem, "fix Step 8.3: the names there"
    layers = list(model.layers)
    sig = [_signature(layer) for layer in layers]
    if len(layers) != len(plan) or any(
        (sig[i] == sig[j]) != (plan[i] == plan[j]) for i in range(len(plan)) for j in range(i)
    ):
        kinds = " ".join(
            type(l).__name__ + (f"({type(l.mixer).__name__})" if hasattr(l, "mixer") else "") for l in layers
        )
        return (
            f"the layers do not follow the plan {plan!r}: {kinds or 'none'}",
            f"build one layer per letter, with my_make_layer (Steps 8.2 and 8.3); {step_hint}",
        )
    pair = _shared(layers)
    if pair:
        return f"layers {pair[0]} and {pair[1]} share their weights", SHARED_HINT + " (Step 8.3)"
    C = model.embed.embedding_dim
    x = torch.randn(1, 5, C, generator=_gen(7)).to(model.embed.weight.dtype)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            mixer, norm = getattr(layer, "mixer", None), getattr(layer, "norm", None)
            if not (isinstance(mixer, nn.Module) and isinstance(norm, nn.Module)):
                continue
            out, inner = layer(x), _first(layer.mixer(layer.norm(x)))
            if _close(out, inner, **TOL32):
                return (
                    f"layer {i} ({plan[i]}) has no residual: its output is mixer(norm(x)) alone",
                    "fix Step 8.1: return x + mixer(norm(x))",
                )
            if not _close(out, x + inner, **TOL32):
                return (f"layer {i} ({plan[i]}) is not x + mixer(norm(x))", "fix Step 8.1: its check names the mistake")
    idx = RECALL_TASK(2, _gen(11))[0]
    # fp32: changing a later token leaves the earlier positions' arithmetic untouched in a causal
    # model, so their logits stay within rounding
    if _leaks(model, idx, TOL32["atol"]) is True:
        leaky = [i for i, layer in enumerate(layers) if _layer_leaks(layer, C)]
        where = (
            f"layer {leaky[0]} ({plan[leaky[0]]}, {type(layers[leaky[0]]).__name__}) lets it through"
            if leaky
            else "no single layer does, so the stack mixes positions (e.g. a norm over the time axis): Step 8.3"
        )
        return "a future token changes the logits at earlier positions (a causal leak)", where
    with torch.no_grad():
        h = model.embed(idx)
        for layer in layers:
            h = _first(layer(h))
        got = _first(model(idx))
        if not _close(got, model.head(model.norm(h)), **TOL32):
            hint = (
                "the final norm is missing: logits = head(norm(x))"
                if _close(got, model.head(h), **TOL32)
                else "forward must be embed -> the layers in order -> norm -> head"
            )
            return "the stack's logits are not head(norm(layers(embed(idx))))", hint + " (Step 8.3)"
    return None


def _layer_leaks(layer, C: int) -> bool:
    x = torch.randn(1, 6, C, generator=_gen(13))
    y = x.clone()
    y[:, -1] += 1.0
    with torch.no_grad():
        a, b = _first(layer(x)), _first(layer(y))
    return not bool(torch.allclose(a[:, :-1], b[:, :-1], atol=TOL32["atol"], rtol=0))


def _structure_problem(model, plan: str, step_hint: str):
    """_trained_model_problem, an exception in the learner's model reported instead of raised."""
    try:
        return _trained_model_problem(model, plan, step_hint)
    except Exception as err:  # the learner's parts, run on other inputs than training gave them
        return (
            f"your trained model raised {type(err).__name__} when checked: {err}",
            "run it by hand: model(idx) for a (2, 13) batch, and each layer on (1, 5, C)",
        )


def _verdict(accuracy: float, task: AssociativeRecall) -> str:
    """What a held-out accuracy says about a model on recall: computed, never assumed."""
    chance, plateau = 1 / task.n_values, 1 / task.n_pairs
    if accuracy >= 0.9:
        return "it looks each key up: recall learned"
    if accuracy > 1.5 * plateau:
        return "above the plateau, not yet reliable: it has started to look keys up"
    if accuracy > 1.5 * chance:
        return (
            f"on the plateau: it answers with some value from the context (about "
            f"1/{task.n_pairs} right), not yet the asked one"
        )
    return "at chance: it has not learned which tokens answer"


def _run_problem(got, steps: int):
    if not (isinstance(got, tuple) and len(got) == 2):
        return (f"returned {type(got).__name__}, expected a tuple (model, losses)", "return model, losses")
    losses = got[1]
    if not isinstance(losses, (list, tuple)) or len(losses) != steps:
        length = len(losses) if isinstance(losses, (list, tuple)) else type(losses).__name__
        return f"losses: {length} for {steps} steps", "append loss.item() once per step"
    finite = lambda v: isinstance(v, (float, int)) and math.isfinite(v)  # noqa: E731
    bad = next((v for v in losses if not finite(v)), None)
    if bad is not None or not all(finite(v) for v in losses):
        if isinstance(bad, torch.Tensor):
            return ("a loss is a tensor", "store loss.item(), a Python float: a tensor keeps its whole graph alive")
        return (f"a loss is {bad}", "the loss became NaN or inf: check the learning rate (RECIPE.lr) and the loss")
    return None


def _loss_hint(err_text: str) -> str | None:
    if "-100" in err_text or "out of bounds" in err_text:
        return (
            "targets hold -100 wherever nothing is asked: F.cross_entropy(logits.reshape(-1, "
            "V), targets.reshape(-1), ignore_index=-100)"
        )
    return None


def _first_loss_hint(model, idx: torch.Tensor, targets: torch.Tensor, got: float) -> str:
    """Which loss the learner computed at the first step, judged on the untrained model."""
    with torch.no_grad():
        logits = _first(model(idx))  # (B, T, V)
        V = logits.shape[-1]

        def ce(lo, tg, **kw) -> float:
            return float(F.cross_entropy(lo.reshape(-1, V), tg.reshape(-1), **kw))

        variants = [
            (
                ce(logits[:, :-1], targets[:, 1:], ignore_index=IGNORE),
                "no shift here: the targets already sit at the answer positions, so logits[:, t] is "
                "scored against targets[:, t] (unlike next-token training on text)",
            ),
            (
                ce(logits, targets, ignore_index=IGNORE, reduction="sum"),
                "average the cross-entropy over the answers (reduction='mean', the default), not the sum",
            ),
        ]
    for value, hint in variants:
        if math.isclose(got, value, rel_tol=1e-4, abs_tol=1e-5):
            return hint
    return (
        "the first loss should be the untrained model's loss on the first batch: seed with "
        "torch.manual_seed(seed) before building the model, draw batches from g = "
        "torch.Generator().manual_seed(seed) with TASK(RECIPE.batch_size, g), and use "
        "F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)"
    )


def _call(name, fn, args, case, n):
    """The learner's run, the caller's random state kept; a loss error gets its hint."""
    got, report = _learner(name, fn, args, case, n)
    if report is not None:
        report.hint = _loss_hint(report.problem or "") or report.hint
    return got, report


def check_recall_training(fn) -> CheckReport:
    """fn(plan, steps, seed) -> (model, losses): a new MyHybrid(CFG, plan, PARTS) built after
    torch.manual_seed(seed), trained `steps` steps on RECALL_TASK batches drawn from a generator
    seeded with `seed`, with RECALL_RECIPE, one loss per step. Passes when the model has the
    plan's structure (residuals, no shared layers, causal), its first loss is the untrained
    model's loss on the first batch, and the loss falls by LOSS_MARGIN; prints the held-out
    accuracy against chance and what it means. Runs on one thread: at these sizes (matrices of
    32 x 64) a second thread only adds synchronisation, and on a busy machine it measured 8x
    slower."""
    with torch_threads(1):
        return _check_recall_training(fn)


def _check_recall_training(fn) -> CheckReport:
    name = "Step 8.4 (training on recall)"
    n = 4
    task, recipe = RECALL_TASK, RECALL_RECIPE
    # 1. two steps of a plan with every letter: is the model built as the plan says?
    case = "plan 'AME', 2 steps: the model's structure"
    got, report = _call(name, fn, ("AME", 2, 1), case, n)
    if report is not None:
        return report
    problem = _run_problem(got, 2) or _structure_problem(got[0], "AME", "MyHybrid(cfg, plan, parts) gets the plan")
    if problem:
        return CheckReport(name, False, n, case, *problem)
    # 2. no step at all: the untrained model, to judge the first loss by
    case = f"plan {TRAIN_PLAN!r}, 0 steps: the untrained model"
    got, report = _call(name, fn, (TRAIN_PLAN, 0, 0), case, n)
    if report is not None:
        return report
    problem = _run_problem(got, 0)
    if problem:
        return CheckReport(name, False, n, case, *problem)
    untrained = got[0]
    # 3. the real run
    case = f"plan {TRAIN_PLAN!r}, {recipe.steps} steps, seed 0"
    start = time.perf_counter()
    got, report = _call(name, fn, (TRAIN_PLAN, recipe.steps, 0), case, n)
    seconds = time.perf_counter() - start
    if report is not None:
        return report
    problem = _run_problem(got, recipe.steps) or _structure_problem(got[0], TRAIN_PLAN, "pass the plan through")
    if problem:
        return CheckReport(name, False, n, case, *problem)
    model, losses = got
    idx, targets = task(recipe.batch_size, _gen(0))  # the first batch, as the learner draws it
    fail = lambda problem, hint=None: CheckReport(name, False, n, case, problem, hint)  # noqa: E731
    try:
        with torch.no_grad():
            expected_first = float(task_loss(untrained, idx, targets))
    except Exception as err:  # the learner's model
        return fail(
            f"your untrained model raised {type(err).__name__}: {err}",
            "run model(idx) by hand on TASK(RECIPE.batch_size, g)",
        )
    tail = recipe.steps // 10
    first, last = float(losses[0]), sum(losses[-tail:]) / tail
    # fp32: the same model on the same batch by the same operations; 1e-4 leaves room for
    # another reduction order, and every wrong loss named differs by far more
    if not math.isclose(first, expected_first, rel_tol=1e-4, abs_tol=1e-5):
        return fail(
            f"the first loss is {first:.4f}, but the untrained model's loss on the first batch is {expected_first:.4f}",
            _first_loss_hint(untrained, idx, targets, first),
        )
    if not last < first - LOSS_MARGIN:
        if bool((model.norm.weight == 1).all()):
            hint = (
                "the weights never moved from their initial values (the final norm's weight "
                "is still all ones): optimizer.zero_grad(), loss.backward(), optimizer.step() "
                "in that order each step, on an optimizer given model.parameters()"
            )
        else:
            hint = (
                f"the loss should fall by more than {LOSS_MARGIN} nats within {recipe.steps} "
                f"steps: AdamW with lr={recipe.lr}, a fresh batch each step, zero_grad "
                "before backward"
            )
        return fail(f"the loss did not fall: {first:.2f} at the first step, {last:.2f} over the last {tail}", hint)
    # 4. the losses reported are the task's loss, and what the model learned
    case = "the trained model on fresh batches"
    try:
        with torch.no_grad():
            held_out = float(task_loss(model, *task(64, _gen(4321))))
        accuracy = task_accuracy(model, task, batches=4, batch_size=64)
    except Exception as err:  # the learner's model on a batch of 64
        return CheckReport(
            name,
            False,
            n,
            case,
            f"your trained model raised {type(err).__name__} on a batch of 64: {err}",
            "run model(idx) by hand on TASK(64, g)",
        )
    if held_out > last + LOSS_HINT_GAP:
        return CheckReport(
            name,
            False,
            n,
            case,
            f"your last losses ({last:.2f}) are far below the task's loss on fresh batches ({held_out:.2f})",
            "draw a fresh batch every step (TASK(RECIPE.batch_size, g) inside the "
            "loop): a model trained on one batch learns it by heart",
        )
    verdict = _verdict(accuracy, task)
    print(
        f"Trained {TRAIN_PLAN!r} for {recipe.steps} steps in {seconds:.1f} s: loss "
        f"{first:.2f} -> {last:.2f} (mean of the last {tail} steps; {held_out:.2f} on fresh "
        f"batches).\nHeld-out accuracy {accuracy:.1%}: chance is 1/{task.n_values} = "
        f"{1 / task.n_values:.0%}, answering with any value in the context 1/{task.n_pairs} = "
        f"{1 / task.n_pairs:.0%}. Verdict: {verdict}."
    )
    report = CheckReport(name, True, n)
    report.details.update(
        first_loss=first, last_loss=last, held_out_loss=held_out, accuracy=accuracy, verdict=verdict, seconds=seconds
    )
    return report
