"""Replaying a training run from disk, when exactly the same run has been made before.

On a CPU, training is a deterministic function of its inputs: the same model (every weight and
buffer, every module's settings, the code of its classes), the same data and arguments, the same
global random state, and the same torch build, numerics and thread count give the same trained
weights, bit for bit. The training functions (`lib.train.train_lm`, `lib.tasks.train_on_task`,
`lib.bert_mlm.train_mlm`, `lib.moe_lm.train_moe_lm`) carry the mark `@lib._replay.replayable`;
`install()` (which `import lib` calls) routes them through `play`, so that a run made once can be
replayed instead of repeated:

    ONEMASK_TRAINING_CACHE=/some/dir         replay a run found there; record every run made
    ONEMASK_TRAINING_CACHE_MODE=record       record only, never replay (train for real every time)

Unset (the default), nothing is read or written and the functions train as always. The key is a
SHA-256 over all of the inputs above, so a run that differs in any of them, down to one bit of
one weight, is a miss and trains for real; a miss only costs time. A replay restores the model's
parameters, gradients and buffers in place, each module's train/eval mode and the attributes the
run reassigned (an MoE layer's last router logits, say), torch's global random state after the
run, and the function's return value; `on_step(step, loss)` is called again with every step's
recorded loss. What a replay cannot give back is time: a cell that times its training measures a
file read. Runs on a GPU are never cached (GPU kernels need not be bitwise reproducible), nor are
runs whose inputs cannot be fingerprinted (an object without a stable state, a module with hooks).

The suite uses it so that JupyterLab, which runs every lesson again after nbval has (with the
same numerics), replays the trainings nbval just made instead of repeating them. A teacher can
run a lesson once before class and replay its trainings live. Entries are pickles (the trained
model's reassigned attributes may be any object): point the variable only at a directory you
made, as you would only import code you trust.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import platform
import tempfile
import types
from numbers import Real
from pathlib import Path

import torch

from lib._replay import set_player
from lib.course.bench import cpu_name

__all__ = ["ENV_DIR", "ENV_MODE", "MODES", "cache_dir", "install", "play", "run_key"]

ENV_DIR = "ONEMASK_TRAINING_CACHE"
ENV_MODE = "ONEMASK_TRAINING_CACHE_MODE"
MODES = ("replay", "record")
# Variables that change which kernels torch, MKL and oneDNN run, hence the last bits of a result.
# ONEMASK_CPU_KERNEL and CC decide whether the Mamba layers train through the fused C loops or the
# PyTorch fallbacks (lib.kernels.scan_cpu), which round differently
_NUMERICS_ENV = (
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "ONEDNN_MAX_CPU_ISA",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "ONEMASK_CPU_KERNEL",
    "CC",
)
_LIB = Path(__file__).resolve().parents[1]


class Unfingerprintable(TypeError):
    """An input whose content cannot be hashed stably: the run is made for real, not cached."""


def cache_dir() -> tuple[Path, str] | None:
    """(directory, mode) from the environment, or None when caching is off."""
    root = os.environ.get(ENV_DIR, "").strip()
    if not root:
        return None
    mode = os.environ.get(ENV_MODE, "").strip() or "replay"
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE} must be one of {', '.join(MODES)} (or unset for replay), got {mode!r}")
    return Path(root), mode


@functools.lru_cache(maxsize=1)
def _lib_digest() -> str:
    """SHA-256 of lib's own source (every .py and .c file): a change to the code is a new key."""
    h = hashlib.sha256()
    for path in sorted(_LIB.rglob("*")):
        if path.suffix in (".py", ".c") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_LIB)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _environment() -> tuple:
    return (
        torch.__version__,
        platform.machine(),
        cpu_name(),
        torch.backends.cpu.get_cpu_capability(),
        torch.get_num_threads(),
        str(torch.get_default_dtype()),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        tuple((k, os.environ.get(k)) for k in _NUMERICS_ENV),
        _lib_digest(),
    )


class _Hasher:
    """Feeds an object's content, recursively, into one SHA-256. An object met twice is fed as a
    reference to the first meeting, so shared (tied) parameters hash differently from copies."""

    def __init__(self):
        self.h = hashlib.sha256()
        self.seen: dict[int, int] = {}
        self.keep: list = []  # keeps every seen object alive, so that no id() is reused meanwhile

    def feed(self, obj) -> None:
        w = self.h.update
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            w(f"{type(obj).__name__}:{obj!r};".encode())
            return
        if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            w(f"torch:{obj};".encode())
            return
        if id(obj) in self.seen:
            w(f"ref:{self.seen[id(obj)]};".encode())
            return
        self.seen[id(obj)] = len(self.seen)
        self.keep.append(obj)
        if isinstance(obj, torch.Tensor):
            self._tensor(obj)
        elif isinstance(obj, torch.nn.Module):
            self._module(obj)
        elif isinstance(obj, (list, tuple)):
            w(f"{type(obj).__name__}[{len(obj)}](".encode())
            for x in obj:
                self.feed(x)
            w(b")")
        elif isinstance(obj, dict):
            w(f"dict[{len(obj)}](".encode())
            for k, v in obj.items():
                self.feed(k)
                self.feed(v)
            w(b")")
        elif isinstance(obj, (set, frozenset)):
            w(f"set[{len(obj)}](".encode())
            for r in sorted(repr(x) for x in obj):
                w(r.encode() + b",")
            w(b")")
        elif type(obj).__module__ == "numpy" and hasattr(obj, "tobytes") and hasattr(obj, "dtype"):
            self.h.update(f"numpy:{obj.dtype}:{getattr(obj, 'shape', ())};".encode() + obj.tobytes())
        elif isinstance(obj, torch.Generator):
            w(b"generator:")
            self._tensor(obj.get_state())
        elif isinstance(obj, types.FunctionType):
            self._function(obj)
        elif isinstance(obj, type):
            self._class(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, types.ModuleType):
            self._class(type(obj))
            self.feed(vars(obj))
        else:
            raise Unfingerprintable(f"cannot fingerprint a {type(obj).__module__}.{type(obj).__qualname__}")

    def _tensor(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            raise Unfingerprintable(f"a tensor on {t.device}: only CPU runs are cached")
        if t.layout != torch.strided or t.is_quantized:
            raise Unfingerprintable(f"a {t.layout} tensor")
        data = t.detach().contiguous().reshape(-1)
        self.h.update(f"tensor:{t.dtype}:{tuple(t.shape)}:{t.requires_grad};".encode())
        if data.numel():
            self.h.update(data.view(torch.uint8).numpy().tobytes())

    def _module(self, m: torch.nn.Module) -> None:
        self._class(type(m))
        for key, value in vars(m).items():
            if "hook" in key:
                if value and ("forward" in key or "backward" in key):
                    raise Unfingerprintable(f"{type(m).__name__} has {key}: a hook may change what training does")
                continue  # state-dict hooks do not take part in training
            self.feed(key)
            self.feed(value)

    def _class(self, cls: type) -> None:
        self.h.update(f"class:{cls.__module__}.{cls.__qualname__};".encode())
        # torch's classes are covered by torch's version, lib's by lib's source digest; any other
        # class (one defined in a notebook, say) by the code of its methods.
        for base in cls.__mro__:
            if base.__module__.split(".")[0] in (
                "torch",
                "lib",
                "builtins",
                "typing",
                "abc",
                "collections",
                "numpy",
                "dataclasses",
                "enum",
                "functools",
            ):
                continue
            for name, value in sorted(vars(base).items()):
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if isinstance(value, property):
                    value = value.fget
                if isinstance(value, types.FunctionType):
                    self.h.update(f"method:{base.__qualname__}.{name};".encode())
                    self._code(value.__code__)

    def _function(self, f: types.FunctionType) -> None:
        self.h.update(f"function:{f.__module__}.{f.__qualname__};".encode())
        self._code(f.__code__)
        self.feed(f.__defaults__)
        self.feed(f.__kwdefaults__)
        self.feed(tuple(c.cell_contents for c in f.__closure__ or ()))

    def _code(self, code: types.CodeType) -> None:
        # what the code does, not where it was written (a notebook cell's file name differs per kernel)
        self.h.update(code.co_code)
        self.h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._code(const)
            else:
                self.h.update(repr(const).encode() + b",")

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def run_key(fn, arguments: dict, *, global_rng: bool = True) -> str:
    """The cache key of calling `fn` with `arguments` (name -> value, `on_step` left out) now:
    SHA-256 over the function, every argument's content, torch's global random state (unless
    `global_rng=False`: a function that seeds it before drawing from it) and the environment that
    decides the numerics. Raises Unfingerprintable for an input it cannot hash."""
    hasher = _Hasher()
    hasher.feed(f"{fn.__module__}.{fn.__qualname__}")
    hasher.feed(_environment())
    if global_rng:
        hasher.feed(torch.random.get_rng_state())
    for name in sorted(arguments):
        hasher.feed(name)
        hasher.feed(arguments[name])
    return hasher.hexdigest()


def _attributes(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """Every module's public attributes before a run (held, so that an identity stays unique)."""
    return {name: {k: v for k, v in vars(m).items() if not k.startswith("_")} for name, m in model.named_modules()}


def _snapshot(model: torch.nn.Module, before: dict[str, dict[str, object]]) -> dict:
    """What a training run left in `model`: tensors, gradients, modes, reassigned attributes."""
    reassigned = {}
    for name, m in model.named_modules():
        old = before.get(name, {})
        changed = {
            k: v
            for k, v in vars(m).items()
            if not k.startswith("_")
            and k != "training"
            and (k not in old or old[k] is not v)
            and not isinstance(v, torch.nn.Parameter)
        }
        if changed:
            reassigned[name] = changed
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "grads": _grads(model),
        "modes": {name: m.training for name, m in model.named_modules()},
        "reassigned": reassigned,
    }


def _usable_entry(path: Path, model: torch.nn.Module | None, on_step) -> dict | None:
    """The entry at `path` if it can replay this call in full, else None (train for real)."""
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, weights_only=False)
        if on_step is not None and entry["steps"] is None:
            return None  # recorded without a callback: no curve to draw again
        if len(entry["returned_grads"]) != len(_modules_in(entry["result"])):
            return None
        if model is not None:
            snap, state = entry["model"], model.state_dict()
            if (
                list(snap["modes"]) != [name for name, _ in model.named_modules()]
                or snap["state"].keys() != state.keys()
            ):
                return None
            if any(snap["state"][k].shape != v.shape or snap["state"][k].dtype != v.dtype for k, v in state.items()):
                return None
        return entry
    except Exception:  # unreadable, truncated or from another version of this module
        return None


def _restore(model: torch.nn.Module, snap: dict) -> None:
    modules = dict(model.named_modules())
    model.load_state_dict(snap["state"])
    _set_grads(model, snap["grads"])
    for name, training in snap["modes"].items():
        modules[name].training = training
    for name, attrs in snap["reassigned"].items():
        for k, v in attrs.items():
            setattr(modules[name], k, v)


def _modules_in(result) -> list[torch.nn.Module]:
    """Modules a function returns (itself, in a list or dict, or as an attribute of a record)."""
    if isinstance(result, torch.nn.Module):
        return [result]
    if isinstance(result, dict):
        items = list(result.values())
    elif isinstance(result, (list, tuple)):
        items = list(result)
    elif hasattr(result, "__dict__"):
        items = list(vars(result).values())
    else:
        return []
    return [x for x in items if isinstance(x, torch.nn.Module)]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _set_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        p.grad = grads[name].clone() if name in grads else None


def _write(path: Path, entry: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(entry, f)
        os.replace(tmp, path)  # atomic: two kernels writing the same run never leave half a file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def play(fn, args: tuple, kwargs: dict, seeds_global_rng: bool = False):
    """Run `fn(*args, **kwargs)`, a function marked `@lib._replay.replayable`: replayed from the
    cache directory where the same run was recorded, else made for real (and recorded).

    `seeds_global_rng` (from the mark) says that the function seeds torch's global generator before
    it draws from it, so the state it is called with is no input of the run (its state after the
    run is still restored by a replay)."""
    signature = inspect.signature(fn)
    config = cache_dir()
    if config is None:
        return fn(*args, **kwargs)
    root, mode = config
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    on_step = arguments.pop("on_step")
    model = arguments.get("model")
    model = model if isinstance(model, torch.nn.Module) else None
    try:
        key = run_key(fn, arguments, global_rng=not seeds_global_rng)
    except Unfingerprintable:
        return fn(*args, **kwargs)
    path = root / f"{fn.__module__}.{fn.__name__}" / f"{key}.pt"

    entry = _usable_entry(path, model, on_step) if mode == "replay" else None
    if entry is not None:  # checked whole before anything is changed: a replay is all or nothing
        if model is not None:
            _restore(model, entry["model"])
        for returned, grads in zip(_modules_in(entry["result"]), entry["returned_grads"]):
            _set_grads(returned, grads)  # pickling a model keeps its weights, not their .grad
        torch.random.set_rng_state(entry["rng"])
        for step, loss in entry["steps"] or ():
            on_step(step, loss)
        return entry["result"]

    steps: list | None = [] if on_step is not None else None
    only_losses = [True]  # a callback given something other than a loss cannot be replayed

    def record(step, value):
        if isinstance(step, int) and isinstance(value, Real) and not isinstance(value, bool):
            steps.append((step, float(value)))
        else:
            only_losses[0] = False
        return on_step(step, value)

    before = _attributes(model) if model is not None else None
    bound.arguments["on_step"] = record if on_step is not None else None
    result = fn(*bound.args, **bound.kwargs)
    if not only_losses[0]:
        return result
    entry = {
        "steps": steps,
        "rng": torch.random.get_rng_state(),
        "result": result,
        "returned_grads": [_grads(m) for m in _modules_in(result)],
        "model": _snapshot(model, before) if model is not None else None,
    }
    try:
        _write(path, entry)
    except Exception:  # a full disk or an object pickle refuses: the run stands, uncached
        pass
    return result


def install() -> None:
    """Route every `@replayable` training function through `play` (`import lib` does this)."""
    set_player(play)
