"""The import contract: mxload's modules form one-way layers (docs/design.md, "Layers").

Every module under mxload/ is read with ``ast`` (nothing is imported): each import it holds,
at the top, under ``if TYPE_CHECKING:`` or inside a function, is an edge from it to the mxload
module it names.  A module may import modules of its own layer and of the layers below, never
one above; the transports (``_runtime/local/``, ``_runtime/ray/``, ``_runtime/threads.py``)
never import each other, and above them only the one module that names them
(``_runtime/transports.py``) imports them.  The modules form no import circle either (strongly
connected components of the same graph), TYPE_CHECKING and lazy imports included: a circle
through a type or a lazy import is still two modules that cannot be understood apart.

A new module goes into ``LAYERS`` here and into the table in docs/design.md.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import re
from collections.abc import Iterable

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The checks of the real tree read its sources (mxload/, csrc/, docs/) beside these tests: run
# from a checkout (the README's test command, CI's clones), not where CI copies the tests out of
# the tree to run them against the installed wheel, which holds no csrc/ or docs/.
in_source_tree = pytest.mark.skipif(
    not ((ROOT / "mxload" / "__init__.py").is_file() and (ROOT / "csrc").is_dir()),
    reason=f"reads the source tree (mxload/, csrc/, docs/), which is not beside these tests ({ROOT})")

# Top to bottom.  A name matches that module; "pkg.**" matches a package and every module in it.
# The most specific match places a module.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("faces", ("mxload", "mxload.torch", "mxload.__main__", "mxload._bench", "mxload._info")),
    ("loader", ("mxload.dataloader", "mxload._iterations", "mxload._checkpoint", "mxload._seeding")),
    ("runtime", ("mxload._runtime.epoch", "mxload._runtime.engine", "mxload._runtime.autotune.**",
                 "mxload._runtime.results", "mxload._runtime.engine_errors", "mxload._runtime.roster",
                 "mxload._runtime.plan", "mxload._runtime.transports")),
    ("transports", ("mxload._runtime.local.**", "mxload._runtime.ray.**", "mxload._runtime.threads")),
    ("contract", ("mxload._runtime", "mxload._runtime.transport", "mxload._runtime.worker",
                  "mxload._runtime.messages", "mxload._runtime.source", "mxload._runtime.shutdown",
                  "mxload._runtime.remote_errors", "mxload._runtime.batch_errors",
                  "mxload._runtime.progress")),
    ("options", ("mxload._options",)),
    ("data/config", ("mxload.dataset", "mxload.sampler", "mxload.batchify", "mxload._collate.**",
                     "mxload.profiler", "mxload._profile_report", "mxload.backends", "mxload.synthetic")),
    ("leaves", ("mxload.errors", "mxload._rng", "mxload._cpus", "mxload._trace", "mxload._checks",
                "mxload._core", "mxload._version", "mxload._words", "mxload._missing_core",
                "mxload._torch_compat", "mxload._keys", "mxload._runtime.os_threads",
                "mxload._runtime.os_signals", "mxload._runtime.os_malloc")),
)

# The transports: no module of one imports a module of another.
TRANSPORTS = ("mxload._runtime.local.**", "mxload._runtime.ray.**", "mxload._runtime.threads")
# The one module above the transports that may import them (it makes a backend's transport).
NAMES_TRANSPORTS = "mxload._runtime.transports"


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int


def module_files(root: pathlib.Path, package: str = "mxload") -> dict[str, pathlib.Path]:
    """Every module of `package` under `root`, by dotted name (a package by its own name), with
    the compiled extensions that have a .pyi (their source is elsewhere: they import nothing)."""
    files: dict[str, pathlib.Path] = {}
    for path in sorted((root / package).rglob("*.py*")):
        if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if path.suffix == ".py" or name not in files:
            files[name] = path
    return files


def imports_of(name: str, path: pathlib.Path, modules: Iterable[str]) -> list[Import]:
    """The mxload modules `name` imports anywhere in its source, one Import per (module, line).
    ``from P import x`` imports P.x when that is a module, else P."""
    known = set(modules)
    if path.suffix == ".pyi":
        return []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[tuple[str, int], Import] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in known else base)
        for target in targets:
            if (target == "mxload" or target.startswith("mxload.")) and target != name:
                found.setdefault((target, node.lineno), Import(name, target, node.lineno))
    return list(found.values())


@functools.cache
def import_graph(root: pathlib.Path = ROOT) -> tuple[dict[str, pathlib.Path], list[Import]]:
    modules = module_files(root)
    edges: list[Import] = []
    for name, path in modules.items():
        edges.extend(imports_of(name, path, modules))
    return modules, edges


def _matches(pattern: str, module: str) -> bool:
    if pattern.endswith(".**"):
        base = pattern[:-3]
        return module == base or module.startswith(base + ".")
    return module == pattern


def _place(module: str, table: Iterable[tuple[str, Iterable[str]]]) -> tuple[int, str, str] | None:
    """(rank, layer, pattern) of the most specific pattern matching `module`; rank 0 is the top."""
    best: tuple[int, str, str] | None = None
    for rank, (layer, patterns) in enumerate(table):
        for pattern in patterns:
            if _matches(pattern, module) and (best is None or len(pattern) > len(best[2])):
                best = (rank, layer, pattern)
    return best


def _transport(module: str, transports: Iterable[str]) -> str | None:
    return next((t for t in transports if _matches(t, module)), None)


@dataclasses.dataclass(frozen=True)
class Violation:
    importer: str
    imported: str | None   # None: `importer` is in no layer
    message: str


def violations(modules: Iterable[str], edges: Iterable[Import],
               layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS,
               transports: tuple[str, ...] = TRANSPORTS,
               names_transports: str = NAMES_TRANSPORTS) -> list[Violation]:
    """Every module in no layer and every import against the rules, each with a message naming
    both modules, both layers and the line."""
    found = [Violation(module, None, f"{module} is in no layer: place it in LAYERS "
                       f"(tests/test_layers.py) and in the table of docs/design.md")
             for module in sorted(modules) if _place(module, layers) is None]
    for edge in edges:
        here, there = _place(edge.importer, layers), _place(edge.imported, layers)
        if here is None or there is None:
            continue
        what = f"{edge.importer} ({here[1]}) -> {edge.imported} ({there[1]}), line {edge.line}"
        mine, theirs = _transport(edge.importer, transports), _transport(edge.imported, transports)
        if there[0] < here[0]:
            why = f"imports upward, from {here[1]} into {there[1]}"
        elif theirs is not None and mine is not None and mine != theirs:
            why = f"one transport imports another ({_package(mine)} -> {_package(theirs)})"
        elif theirs is not None and mine is None and edge.importer != names_transports:
            why = f"only {names_transports} names the transports"
        else:
            continue
        found.append(Violation(edge.importer, edge.imported, f"{what}: {why}"))
    return found


def _package(pattern: str) -> str:
    return pattern[:-3] if pattern.endswith(".**") else pattern


def circles(modules: Iterable[str], edges: Iterable[Import]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (or a module
    importing itself), each sorted, by Tarjan's algorithm (iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


@in_source_tree
def test_every_module_is_in_a_layer_and_no_import_runs_upward_or_across_transports():
    modules, edges = import_graph()
    assert "mxload._runtime.engine" in modules and len(edges) > 100, "the walk found mxload's modules"
    found = [v.message for v in violations(modules, edges)]
    assert not found, "imports against the layers (docs/design.md):\n" + "\n".join(found)


@in_source_tree
def test_no_import_circle():
    modules, edges = import_graph()
    found = circles(modules, edges)
    assert not found, "import circles (TYPE_CHECKING and lazy imports included):\n" + "\n".join(
        " <-> ".join(c) for c in found)


# The checker itself: a planted back-import, a sideways import across transports, an unplaced
# module and a circle, in a synthetic tree of its own, each fail with both modules and layers named.

def _plant(tmp_path: pathlib.Path, files: dict[str, str]) -> tuple[dict[str, pathlib.Path], list[Import]]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path)


def test_the_checker_fails_on_a_planted_back_import(tmp_path):
    modules, edges = _plant(tmp_path, {
        "mxload/__init__.py": "from . import dataloader\n",
        "mxload/dataloader.py": "from ._runtime import engine\n",
        "mxload/_runtime/__init__.py": "",
        "mxload/_runtime/engine.py": "def f():\n    from ..dataloader import DataLoader\n",
        "mxload/errors.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from .sampler import S\n"),
        "mxload/sampler.py": "from . import errors\n",
    })
    found = [v.message for v in violations(modules, edges)]
    assert any("mxload._runtime.engine (runtime) -> mxload.dataloader (loader), line 2: imports upward"
               in p for p in found), found
    assert any("mxload.errors (leaves) -> mxload.sampler (data/config), line 3: imports upward" in p
               for p in found), found
    assert len(found) == 2, found
    assert sorted(map(sorted, circles(modules, edges))) == [
        ["mxload._runtime.engine", "mxload.dataloader"], ["mxload.errors", "mxload.sampler"]]


def test_the_checker_fails_across_transports_and_on_an_unplaced_module(tmp_path):
    modules, edges = _plant(tmp_path, {
        "mxload/_runtime/__init__.py": "",
        "mxload/_runtime/ray/__init__.py": "",
        "mxload/_runtime/ray/transport.py": "from ..local import launcher\nfrom .. import messages\n",
        "mxload/_runtime/local/__init__.py": "",
        "mxload/_runtime/local/launcher.py": "import mxload._runtime.messages\n",
        "mxload/_runtime/messages.py": "",
        "mxload/_runtime/engine.py": "from .threads import ThreadTransport\n",
        "mxload/_runtime/transports.py": "from .threads import ThreadTransport\n",
        "mxload/_runtime/threads.py": "",
        "mxload/newcomer.py": "",
    })
    found = [v.message for v in violations(modules, edges)]
    assert any("mxload._runtime.ray.transport (transports) -> mxload._runtime.local.launcher (transports), "
               "line 1: one transport imports another (mxload._runtime.ray -> mxload._runtime.local)"
               in p for p in found), found
    assert any("mxload._runtime.engine (runtime) -> mxload._runtime.threads (transports), line 1: "
               "only mxload._runtime.transports names the transports" in p for p in found), found
    assert any(p.startswith("mxload.newcomer is in no layer") for p in found), found
    assert len(found) == 3, found
    assert circles(modules, edges) == []


@in_source_tree
def test_the_real_tree_is_walked_as_python_imports_it():
    """Spot checks of the walk on the real tree: a relative import of a submodule, one inside a
    function, one under TYPE_CHECKING, and the compiled core (known by its .pyi)."""
    modules, edges = import_graph()
    assert "mxload._core" in modules
    pairs = {(e.importer, e.imported) for e in edges}
    assert ("mxload.errors", "mxload._core") in pairs                                  # the core
    assert ("mxload._runtime.local.zygote", "mxload._runtime.local.wire") in pairs    # from . import wire
    assert ("mxload._runtime.transports", "mxload._runtime.ray.transport") in pairs   # in a function
    assert ("mxload._runtime.autotune.producer", "mxload._runtime.plan") in pairs     # TYPE_CHECKING


# Named notes (docs/design.md, "Named notes"): a design spanning several files is written once,
# under a line of its own, ``NOTE [ Name ]`` (a comment, a docstring line or a heading), and cited
# by that name wherever the code takes part.

NOTE_SOURCES = ("mxload/**/*.py", "csrc/*.pyx", "csrc/*.pxi", "csrc/*.pxd", "csrc/*.h", "docs/*.md")
_NOTE = re.compile(r"NOTE \[ ([^\]\n]+?) \]")


def notes(root: pathlib.Path = ROOT) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(where each note is written, where each is cited), as "path:line" lists."""
    written: dict[str, list[str]] = {}
    cited: dict[str, list[str]] = {}
    for pattern in NOTE_SOURCES:
        for path in sorted(root.glob(pattern)):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for match in _NOTE.finditer(line):
                    bare = line.strip().lstrip("#\"' ").rstrip(":\"' ")
                    where = f"{path.relative_to(root)}:{number}"
                    kind = written if bare == match.group(0) else cited
                    kind.setdefault(match.group(1), []).append(where)
    return written, cited


def note_problems(root: pathlib.Path = ROOT) -> list[str]:
    """Every note written other than once, cited from no other file of the code, or missing from
    docs/design.md's table of notes."""
    written, cited = notes(root)
    design = (root / "docs" / "design.md").read_text()
    problems = []
    for name in sorted(set(written) | set(cited)):
        places = written.get(name, [])
        if len(places) != 1:
            problems.append(f"NOTE [ {name} ] must be written once (a line of its own), found at "
                            f"{places or 'no place'}; cited at {cited.get(name)}")
            continue
        in_code = [c for c in cited.get(name, []) if not c.startswith("docs/")
                   and c.rpartition(":")[0] != places[0].rpartition(":")[0]]
        if not in_code:
            problems.append(f"NOTE [ {name} ] ({places[0]}) is cited from no other file of the code")
        if f"| NOTE [ {name} ] |" not in design:
            problems.append(f"NOTE [ {name} ] is not in docs/design.md's table of notes")
    return problems


@in_source_tree
def test_every_note_is_written_once_and_cited():
    written, _ = notes()
    assert "Signal-safe hand-over" in written, "the notes were found"
    problems = note_problems()
    assert not problems, "\n".join(problems)


def test_the_note_check_fails_on_a_note_unwritten_twice_written_or_uncited(tmp_path):
    for rel, text in {
        "docs/design.md": "| NOTE [ Once ] |\n| NOTE [ Twice ] |\n### NOTE [ Lonely ]\n",
        "mxload/a.py": "# NOTE [ Once ]\n# NOTE [ Twice ]\nx = 1   # NOTE [ Nowhere ]\n",
        "csrc/b.pxi": "# as NOTE [ Once ] says\n# NOTE [ Twice ]\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    problems = note_problems(tmp_path)
    assert [p.split(" ] ")[0] for p in problems] == [
        "NOTE [ Lonely", "NOTE [ Lonely", "NOTE [ Nowhere", "NOTE [ Twice"], problems
    assert "is cited from no other file" in problems[0] and "not in docs/design.md" in problems[1]
    assert "found at no place" in problems[2] and "found at ['mxload/a.py:2', 'csrc/b.pxi:2']" in problems[3]


@in_source_tree
def test_the_runtime_map_names_every_runtime_module():
    """mxload/_runtime/__init__.py maps the runtime module by module (docs/design.md points
    there): a module added or moved is named in it."""
    modules, _ = import_graph()
    text = (ROOT / "mxload" / "_runtime" / "__init__.py").read_text()
    missing = [name for name, path in sorted(modules.items()) if name.startswith("mxload._runtime.")
               and (name.rpartition(".")[2] + ("/" if path.name == "__init__.py" else ".py")) not in text]
    assert not missing, f"not in mxload/_runtime/__init__.py's map: {missing}"


def test_importing_mxload_loads_no_transport_and_thread_workers_no_process_machinery():
    """What the layers mean at run time: `import mxload` loads no transport (the worker loop
    imports none), and a loader with worker threads loads the thread transport alone, never the
    process machinery of _runtime/local/ (nor Ray)."""
    from fresh_python import run

    result = run("""
        def transports():
            return sorted(m for m in sys.modules if m.startswith(("mxload._runtime.local",
                          "mxload._runtime.ray", "mxload._runtime.threads")))
        print(transports())
        loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(8)), batch_size=2, num_workers=2,
                                   thread_pool=True)
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        print(transports())
    """, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "['mxload._runtime.threads']"], result.stdout
