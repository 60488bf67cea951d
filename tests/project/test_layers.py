"""lib's layers, read from its import graph: kernels below layers below models below the course's
machinery (`lib.course`), `_checks` and `_replay` under everything, `widgets` above lib, no cycle,
no private name taken across modules, and importing the course changes the environment only in
the one documented way."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

# Each module of lib, by layer, lowest first. A module may import its own layer and those below,
# never one above. A new module must be placed here (the test says so).
LAYERS = {
    "base": {"lib._checks", "lib._door", "lib._replay"},
    "kernels": {
        "lib.kernels",
        "lib.kernels.c_build",
        "lib.kernels.cpu_layers",
        "lib.kernels.flash",
        "lib.kernels.flash_backward",
        "lib.kernels.matvec",
        "lib.kernels.no_triton",
        "lib.kernels.runtime",
        "lib.kernels.scan",
        "lib.kernels.scan_cpu",
    },
    "layers": {
        "lib.masks",
        "lib.attention",
        "lib.rope",
        "lib.norms",
        "lib.conv",
        "lib.scan",
        "lib.scan_parallel",
        "lib.lti",
        "lib.ssd",
        "lib.kv_cache",
        "lib.paging",
        "lib.sampling",
        "lib.moe",
        "lib.moe_counts",
        "lib.lora",
        "lib.quant",
    },
    "models": {
        "lib.bert",
        "lib.bert_mlm",
        "lib.gpt",
        "lib.llama",
        "lib.smollm2",
        "lib.encdec",
        "lib.mamba",
        "lib.mamba_lm",
        "lib.hybrid",
        "lib.moe_lm",
        "lib.moe_parallel",
        "lib.decode",
        "lib.serving",
        "lib.serving_result",
        "lib.workload",
        "lib.train",
        "lib.tasks",
        "lib.corpus",
        "lib.toy",
        "lib.probes",
    },
    "course": "lib.course",  # every module under lib.course: the machinery
    "package": {"lib"},  # lib/__init__.py: the debug switch, Triton's mode, the replay cache plugged in
}
ORDER = list(LAYERS)


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def layer_of(module: str) -> str | None:
    for layer, members in LAYERS.items():
        if (module == members or module.startswith(members + ".")) if isinstance(members, str) else module in members:
            return layer
    return None


def import_graph(package: str) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Every import in `package` (function-level ones too), as module -> the modules it imports
    from the project, and every private name (`_x`) one module takes from another."""
    modules = {_module_name(p) for p in (ROOT / "lib").rglob("*.py")} | {
        _module_name(p) for p in (ROOT / package).rglob("*.py")
    }
    edges, private = {}, []
    for path in (ROOT / package).rglob("*.py"):
        me = _module_name(path)
        edges.setdefault(me, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[me] |= {a.name for a in node.names if a.name.split(".")[0] in ("lib", "widgets")} - {me}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("lib", "widgets"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"  # `from lib.kernels import scan_cpu` imports a module
                    target = sub if sub in modules else node.module
                    if target != me:
                        edges[me].add(target)
                        if alias.name.startswith("_") and target == node.module:
                            private.append((me, node.module, alias.name))
    return edges, private


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for other in sorted(edges.get(module, ())):
            if state.get(other) == "open":
                cycles.append(path[path.index(other) :] + [module, other])
            elif other in edges and other not in state:
                visit(other, path + [module])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    return cycles


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Each import that goes up a layer (or touches a module no layer holds), in words."""
    found = []
    for module, targets in sorted(edges.items()):
        mine = layer_of(module)
        if mine is None:
            found.append(f"{module} is in no layer: place it in LAYERS")
            continue
        for target in sorted(targets):
            theirs = layer_of(target) if target.startswith("lib") else "widgets"
            if theirs == "widgets" or theirs is None or ORDER.index(theirs) > ORDER.index(mine):
                found.append(f"{module} ({mine}) imports {target} ({theirs})")
    return found


def test_lib_imports_go_down_the_layers_only():
    edges, private = import_graph("lib")
    assert import_cycles(edges) == []
    assert layer_violations(edges) == []
    assert private == [], "a private name used across modules should be public, or live where it is used"


def test_kernels_know_nothing_of_their_callers():
    edges, _ = import_graph("lib")
    for module, targets in edges.items():
        if module.startswith("lib.kernels"):  # kernels -> their runtime (and the shared validators), never up
            assert targets <= {"lib._checks"} | {t for t in edges if t.startswith("lib.kernels")}, (module, targets)


def test_widgets_sit_above_lib_and_train_nothing():
    edges, _ = import_graph("widgets")
    for module, targets in edges.items():
        assert all(t.split(".")[0] in ("lib", "widgets") for t in targets)
        # a widget draws what it is given: the gallery's trained models come from lib.course.demos
        assert not targets & {"lib.train", "lib.moe_lm"}, (module, targets & {"lib.train", "lib.moe_lm"})
    for path in (ROOT / "widgets").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lib"):
                assert not any(a.name.startswith("train") for a in node.names), (path.name, node.module)


def test_the_layer_check_finds_an_upward_import_and_an_unplaced_module():
    assert layer_violations({"lib.gpt": {"lib.course.claims"}}) == [
        "lib.gpt (models) imports lib.course.claims (course)"
    ]
    assert layer_violations({"lib.masks": {"lib.gpt"}}) == ["lib.masks (layers) imports lib.gpt (models)"]
    assert layer_violations({"lib.kernels.flash": {"lib.attention"}}) != []
    assert layer_violations({"lib.attention": {"widgets.mask_explorer"}}) != []
    assert layer_violations({"lib.new_thing": set()}) == ["lib.new_thing is in no layer: place it in LAYERS"]
    assert layer_violations({"lib.course.claims": {"lib.gpt", "lib._checks"}, "lib": {"lib.course"}}) == []


def test_the_import_graph_check_finds_a_cycle_and_a_private_import():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    assert import_cycles({"a": {"a.x"}, "a.x": {"a"}}) != []


def test_importing_every_module_changes_the_environment_only_by_tritons_mode():
    # Without a CUDA GPU, `import lib` sets TRITON_INTERPRET=1 unless it is set: Triton fixes its
    # mode at its first import, and torch's own modules (the FLOP counter lib.course.compare uses,
    # torch.compile) import triton, so the first kernel call would be too late. Nothing else.
    modules = sorted({_module_name(p) for package in ("lib", "widgets") for p in (ROOT / package).rglob("*.py")})
    script = (
        "import importlib, json, os, sys\n"
        "before = dict(os.environ)\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "after = dict(os.environ)\n"
        "print(json.dumps({k: after.get(k) for k in set(before) | set(after) if before.get(k) != after.get(k)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", script, *modules], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    changed = json.loads(run.stdout.strip().splitlines()[-1])
    assert changed == ({} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"})
