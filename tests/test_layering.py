"""The architecture as tests.

* every module of ``deepfusion`` and ``diffnet`` lives in a room (:data:`ROOMS`: what it owns,
  and the rooms it may import); an import along no allowed arrow fails, lazy imports included,
  naming the file and the import; the rooms' arrows run one way, and no modules anywhere in
  ``deepfusion/`` and ``diffnet/`` import each other in a cycle;
* diffnet (the science) never imports MPI and never imports deepfusion;
* deepfusion never names a PDE: not by importing its module, not as a string (a problem or an
  input channel of the registry written as a literal, or a problem named in any text), and no
  private name is imported from another module;
* no command is plugged in through ``__import__`` or ``importlib``;
* the product (diffnet, deepfusion) and the benchmarks never import the lab (lab/ may import
  them: it is the research record built on the product), nor the tests, and the product's tests
  run no lab code.
"""
import ast
import functools
import pathlib
import re
from collections import namedtuple

from diffnet.problems import PROBLEMS

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("deepfusion", "diffnet")

Room = namedtuple("Room", "owns may_import")
# room -> what it owns and the rooms it may import (derived from the imports as they are, in the
# order config <- engine.errors <- engine.parallel / checkpoint <- engine.run <- engine.predict <-
# engine.train <- app <- jobs <- cli, and diffnet.problems.contract <- families, check). A room
# is a module prefix; a module belongs to the longest room that is its name or a package of it.
ROOMS = {
    "deepfusion.version": Room("the version, stated once", ()),
    "deepfusion.config": Room("the configuration: typed TOML sections, --set overrides", ()),
    "deepfusion.engine.errors": Room("the failures the engine raises on purpose", ()),
    "deepfusion.engine.checkpoint": Room("atomic, sealed, self-verifying HDF5 checkpoints", ()),
    "deepfusion.engine.parallel": Room(
        "communicator, threads, the pool's split, memory formats, gradient buckets, halos, "
        "parallelize", ("diffnet",)),
    "deepfusion.engine.run": Room(
        "the run directory's lock and log, ETA, stop signals and watchdog, the launcher's "
        "keeper, the test hook",
        ("deepfusion.engine.errors", "deepfusion.engine.checkpoint")),
    "deepfusion.engine.predict": Room(
        "the one prediction service: a checkpoint loaded for prediction, the pipeline, the "
        "ranks' shares, the sinks; held-out evaluation, refinement, field figures",
        ("deepfusion.config", "deepfusion.engine.checkpoint", "deepfusion.engine.parallel",
         "deepfusion.engine.run", "diffnet", "diffnet.problems")),
    "deepfusion.engine.train": Room(
        "the trainer's loop, the global step, the optimisers, the level plan",
        ("deepfusion.config", "deepfusion.engine.errors", "deepfusion.engine.checkpoint",
         "deepfusion.engine.parallel", "deepfusion.engine.run", "deepfusion.engine.predict")),
    "deepfusion.app": Room(
        "the commands and their support: building a run, the error policy, inference, "
        "checks (deepfusion.app.checks: what tools outside the app may call)",
        ("deepfusion.version", "deepfusion.config", "deepfusion.engine.errors",
         "deepfusion.engine.checkpoint", "deepfusion.engine.parallel", "deepfusion.engine.run",
         "deepfusion.engine.predict", "deepfusion.engine.train", "diffnet", "diffnet.problems",
         "diffnet.problems.check")),
    "deepfusion.jobs": Room(
        "job scripts, scaling sweeps, the scaling models, time-to-accuracy projections",
        ("deepfusion.config", "deepfusion.engine.errors", "deepfusion.app")),
    "deepfusion.cli": Room(
        "the top: the deepfusion command (cli, __main__) and the package root "
        "(deepfusion.load)",
        ("deepfusion.version", "deepfusion.engine.run", "deepfusion.app", "deepfusion.jobs")),
    "diffnet": Room("the science's shared modules: grids, stencils, generators, norms, "
                    "split layers, resampling, validation", ()),
    "diffnet.reference": Room("reference solvers", ("diffnet",)),
    "diffnet.problems.contract": Room(
        "the contract a PDE family implements, its helpers, the registry", ("diffnet",)),
    "diffnet.problems.families": Room(
        "the built-in PDE families", ("diffnet", "diffnet.problems.contract", "diffnet.reference")),
    "diffnet.problems": Room(
        "the problems' public API: the registry filled with the built-in families",
        ("diffnet", "diffnet.problems.contract", "diffnet.problems.families")),
    "diffnet.problems.check": Room(
        "the problem checker (deepfusion check-problem)",
        ("diffnet", "diffnet.problems", "diffnet.problems.contract")),
}
# modules of the top room that are not under deepfusion.cli
TOP = {"deepfusion": "deepfusion.cli", "deepfusion.__main__": "deepfusion.cli"}
# an arrow that admits one module of the room it points to
THROUGH = {("deepfusion.jobs", "deepfusion.app"): "deepfusion.app.checks"}
# the one import by name in deepfusion: the test hook names a module, never a command
IMPORT_BY_NAME = "deepfusion/engine/run/hook.py"

# Written by runs, not by us (gitignored): bench/out holds TorchInductor's generated kernels
# after `python -m bench.step_bench --compile --out bench/out/...`.
GENERATED = ("bench", "out")


def modules(pkg):
    for path in sorted((ROOT / pkg).rglob("*.py")):
        if path.relative_to(ROOT).parts[:2] != GENERATED:
            yield path, parsed(path)


@functools.cache
def parsed(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text())


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path, tree):
    """(module imported, names, line) for every import in the file, lazy ones included."""
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            yield mod, [a.name for a in node.names], node.lineno


def room_of(mod: str):
    """The room of module ``mod`` (None: a module of no room)."""
    if mod in TOP:
        return TOP[mod]
    rooms = [r for r in ROOMS if mod == r or mod.startswith(r + ".")]
    return max(rooms, key=len) if rooms else None


@functools.cache
def product_modules() -> dict:
    """{module name: (path, tree)} of every module of deepfusion and diffnet."""
    return {module_name(p): (p, t) for pkg in PRODUCT for p, t in modules(pkg)}


def targets(mod: str, names, known) -> list[str]:
    """The modules an import reaches: ``from X import n`` runs X, and X.n when that is a module."""
    return [mod] + [f"{mod}.{n}" for n in names if f"{mod}.{n}" in known]


def bad_arrows(path, tree, known) -> list[str]:
    """'file:line: import X (room A -> room B)' for every import of the file along no arrow."""
    me = module_name(path)
    mine, bad = room_of(me), []
    for mod, names, line in imports(path, tree):
        if mod.split(".")[0] not in (*PRODUCT, "tests", "bench", "lab", "jobs"):
            continue  # the standard library and third-party packages
        for t in targets(mod, names, known):
            theirs = room_of(t)
            if theirs == mine or (theirs is None and t in known):
                continue  # inside the room, or a package in no room (it imports nothing)
            allowed = mine is not None and theirs in ROOMS[mine].may_import
            through = THROUGH.get((mine, theirs))
            if not allowed or (through and t not in (through, theirs)):
                bad.append(f"{path.relative_to(ROOT)}:{line}: import {t} ({mine} -> {theirs})")
    return bad


def test_every_module_is_in_a_room_or_imports_nothing():
    known = product_modules()
    stray = [str(p.relative_to(ROOT)) for m, (p, t) in known.items()
             if room_of(m) is None and any(True for _ in imports(p, t))]
    assert not stray, f"modules in no room of ROOMS (add the room, or move them): {stray}"


def test_every_import_follows_an_arrow_between_rooms():
    known = product_modules()
    bad = [b for p, t in known.values() for b in bad_arrows(p, t, known)]
    assert not bad, "imports along no arrow of ROOMS (move the piece to the room that owns " \
                    "it):\n" + "\n".join(bad)


def test_the_arrows_between_rooms_run_one_way():
    graph = {r: set(room.may_import) for r, room in ROOMS.items()}
    assert all(t in ROOMS for deps in graph.values() for t in deps)
    assert find_cycle(graph) is None, f"a cycle of rooms: {find_cycle(graph)}"


def test_the_arrow_check_names_the_file_and_the_import():
    known = product_modules()
    path = ROOT / "deepfusion" / "engine" / "train" / "x.py"
    tree = ast.parse("def f():\n    from deepfusion.app import build\n")
    assert bad_arrows(path, tree, known) == [
        f"deepfusion/engine/train/x.py:2: import {m} (deepfusion.engine.train -> deepfusion.app)"
        for m in ("deepfusion.app", "deepfusion.app.build")]
    jobs = ROOT / "deepfusion" / "jobs" / "x.py"
    assert bad_arrows(jobs, ast.parse("from deepfusion.app import checks\n"), known) == []
    assert bad_arrows(jobs, ast.parse("from deepfusion.app.check import check_launch\n"), known)
    assert bad_arrows(jobs, ast.parse("from tests.slurm_local import client\n"), known)


def find_cycle(graph: dict):
    """One cycle of ``graph`` (node -> nodes) as a list of nodes, or None."""
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                path = stack + [m]
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d, stack + [m])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [])
            if found:
                return found
    return None


def test_no_import_cycles_in_deepfusion_or_diffnet():
    known = product_modules()
    where = {(me, t): f"{p.relative_to(ROOT)}:{line}" for me, (p, tree) in known.items()
             for mod, names, line in imports(p, tree) for t in targets(mod, names, known)
             if t in known and t != me}
    graph = {me: set() for me in known}
    for me, t in where:
        graph[me].add(t)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle:\n" + "\n".join(
        f"{where[a, b]}: {a} imports {b}" for a, b in zip(cycle, cycle[1:]))


def test_nothing_but_the_lab_imports_the_lab_and_the_product_never_the_tests():
    bad = [(str(p.relative_to(ROOT)), m) for pkg in ("diffnet", "deepfusion", "bench", "tests")
           for p, t in modules(pkg) for m, _, _ in imports(p, t) if m.split(".")[0] == "lab"]
    assert not bad, f"the lab is the research record; move what the product needs out of it: {bad}"
    bad = [(str(p.relative_to(ROOT)), m) for pkg in PRODUCT for p, t in modules(pkg)
           for m, _, _ in imports(p, t) if m.split(".")[0] == "tests"]
    assert not bad, f"the installed product has no tests package: {bad}"


def test_diffnet_never_imports_mpi_or_the_engine():
    bad = [(str(p), m) for p, t in modules("diffnet") for m, _, _ in imports(p, t)
           if m.split(".")[0] in ("mpi4py", "deepfusion")]
    assert not bad, bad


def test_no_private_names_imported_across_modules():
    bad = [(str(p.relative_to(ROOT)), m, n) for pkg in ("deepfusion", "diffnet", "bench")
           for p, t in modules(pkg) for m, names, _ in imports(p, t) for n in names
           if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


def test_deepfusion_never_imports_a_specific_pde():
    not_a_pde = ("contract", "check")      # the contract and its checker (check-problem)
    bad = [(str(p), m) for p, t in modules("deepfusion") for m, _, _ in imports(p, t)
           if m.startswith("diffnet.problems.") and m.split(".")[2] not in not_a_pde]
    assert not bad, bad


def _strings(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


# A problem's name as a word, or as the start or end of a file or identifier name
# (configs/recipes/NAME_512.toml): letters and digits around it make another word.
PDE_WORDS = re.compile(r"(?<![a-z0-9])(" + "|".join(sorted(PROBLEMS)) + r")(?![a-z0-9])",
                       re.IGNORECASE)


def test_deepfusion_never_names_a_pde_or_its_channels_in_a_string():
    literals = set(PROBLEMS)
    for cls in PROBLEMS.values():  # one-letter channel names (a time "t") are too common to ban
        literals |= {c for c in cls.input_channels if len(c) > 1}
    bad = []
    for path, tree in modules("deepfusion"):
        for s in _strings(tree):
            if s in literals or PDE_WORDS.search(s):
                bad.append((str(path.relative_to(ROOT)), s[:60]))
    assert not bad, f"deepfusion/ names a PDE (or its channels) as a string: {bad}"


def test_the_layering_check_catches_a_pde_string():
    tree = ast.parse('if problem.name == "poisson":\n    ch = "nu"\n')
    found = set(_strings(tree))
    assert "poisson" in PROBLEMS and found & set(PROBLEMS)
    assert "nu" in {c for cls in PROBLEMS.values() for c in cls.input_channels} & found
    assert PDE_WORDS.search("--config configs/recipes/poisson_fine.toml")
    assert not PDE_WORDS.search("a Poissonian guess")


def test_no_dynamic_imports_of_commands():
    bad = [str(p.relative_to(ROOT)) for p, t in modules("deepfusion")
           for m, _, _ in imports(p, t)
           if m == "importlib" and str(p.relative_to(ROOT)) != IMPORT_BY_NAME]
    bad += [str(p.relative_to(ROOT)) for p, t in modules("deepfusion")
            for node in ast.walk(t) if isinstance(node, ast.Name) and node.id == "__import__"]
    assert not bad, bad
