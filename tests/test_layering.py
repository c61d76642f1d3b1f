"""The architecture as tests.

* diffnet (the science) never imports MPI and never imports deepfusion;
* imports inside deepfusion run one way: app -> engine -> config (no cycles, lazy imports
  included), and no private name is imported from another module;
* deepfusion never names a PDE: not by importing its module, not as a string (a problem or an
  input channel of the registry written as a literal, or a problem named in any text);
* no command is plugged in through ``__import__`` or ``importlib``;
* the product (diffnet, deepfusion, jobs) and the benchmarks never import the lab (lab/ may import
  them: it is the research record built on the product), and the product's tests run no lab code.
"""
import ast
import pathlib
import re

from diffnet.problems import PROBLEMS

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"config": 0, "engine": 1, "app": 2}


# Written by runs, not by us (gitignored): bench/out holds TorchInductor's generated kernels
# after `python -m bench.step_bench --compile --out bench/out/...`.
GENERATED = ("bench", "out")


def modules(pkg):
    for path in sorted((ROOT / pkg).rglob("*.py")):
        if path.relative_to(ROOT).parts[:2] != GENERATED:
            yield path, ast.parse(path.read_text())


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path, tree):
    """(module imported, names) for every import in the file, lazy ones included."""
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            yield mod, [a.name for a in node.names]


def test_nothing_but_the_lab_imports_the_lab():
    bad = [(str(p.relative_to(ROOT)), m) for pkg in ("diffnet", "deepfusion", "jobs", "bench", "tests")
           for p, t in modules(pkg) for m, _ in imports(p, t) if m.split(".")[0] == "lab"]
    assert not bad, f"the lab is the research record; move what the product needs out of it: {bad}"


def test_diffnet_never_imports_mpi_or_the_engine():
    bad = [(str(p), m) for p, t in modules("diffnet") for m, _ in imports(p, t)
           if m.split(".")[0] in ("mpi4py", "deepfusion")]
    assert not bad, bad


def test_deepfusion_layers_import_one_way():
    bad = []
    for path, tree in modules("deepfusion"):
        mine = module_name(path).split(".")
        if len(mine) < 2 or mine[1] not in LAYERS:
            continue
        for mod, names in imports(path, tree):
            parts = mod.split(".")
            targets = [parts] + [parts + [n] for n in names]
            for t in targets:
                if len(t) > 1 and t[0] == "deepfusion" and t[1] in LAYERS \
                        and LAYERS[t[1]] > LAYERS[mine[1]]:
                    bad.append((str(path.relative_to(ROOT)), mod))
    assert not bad, f"imports against the layering app -> engine -> config: {bad}"


def test_no_import_cycles_in_deepfusion():
    known = {module_name(p) for p, _ in modules("deepfusion")}
    graph = {}
    for path, tree in modules("deepfusion"):
        me = module_name(path)
        deps = set()
        for mod, names in imports(path, tree):
            for cand in [mod] + [f"{mod}.{n}" for n in names]:
                if cand in known and cand != me and not me.startswith(cand + "."):
                    deps.add(cand)
        graph[me] = deps
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in graph.get(m, ()):
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack + [m, d]))
            if d not in state:
                visit(d, stack + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


def test_no_private_names_imported_across_modules():
    bad = [(str(p.relative_to(ROOT)), m, n) for pkg in ("deepfusion", "diffnet", "jobs", "bench")
           for p, t in modules(pkg) for m, names in imports(p, t) for n in names
           if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


def test_deepfusion_never_imports_a_specific_pde():
    not_a_pde = ("base", "check")      # the contract and its checker (check-problem)
    bad = [(str(p), m) for p, t in modules("deepfusion") for m, _ in imports(p, t)
           if m.startswith("diffnet.problems.") and m.split(".")[2] not in not_a_pde]
    assert not bad, bad


def _strings(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def test_deepfusion_never_names_a_pde_or_its_channels_in_a_string():
    literals = set(PROBLEMS)
    for cls in PROBLEMS.values():  # one-letter channel names (a time "t") are too common to ban
        literals |= {c for c in cls.input_channels if len(c) > 1}
    words = re.compile(r"\b(" + "|".join(sorted(PROBLEMS)) + r")\b", re.IGNORECASE)
    bad = []
    for path, tree in modules("deepfusion"):
        for s in _strings(tree):
            if s in literals or words.search(s):
                bad.append((str(path.relative_to(ROOT)), s[:60]))
    assert not bad, f"deepfusion/ names a PDE (or its channels) as a string: {bad}"


def test_the_layering_check_catches_a_pde_string():
    tree = ast.parse('if problem.name == "poisson":\n    ch = "nu"\n')
    found = set(_strings(tree))
    assert "poisson" in PROBLEMS and found & set(PROBLEMS)
    assert "nu" in {c for cls in PROBLEMS.values() for c in cls.input_channels} & found


def test_no_dynamic_imports_of_commands():
    bad = [str(p.relative_to(ROOT)) for pkg in ("deepfusion", "jobs") for p, t in modules(pkg)
           for m, _ in imports(p, t) if m == "importlib"]
    bad += [str(p.relative_to(ROOT)) for pkg in ("deepfusion", "jobs") for p, t in modules(pkg)
            for node in ast.walk(t) if isinstance(node, ast.Name) and node.id == "__import__"]
    assert not bad, bad
