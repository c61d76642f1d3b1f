"""The package contract: diffnet (the science) never imports MPI; deepfusion (the engine) never
names a specific PDE -- it reaches problems only through diffnet's registry by name."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imports(pkg):
    for path in sorted((ROOT / pkg).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    yield path, a.name
            elif isinstance(node, ast.ImportFrom) and node.module:
                yield path, node.module


def test_diffnet_never_imports_mpi():
    bad = [(str(p), m) for p, m in imports("diffnet") if m.split(".")[0] == "mpi4py"]
    assert not bad, bad


def test_deepfusion_never_imports_a_specific_pde():
    pdes = ("burgers", "poisson", "reaction_diffusion", "fields")
    bad = [(str(p), m) for p, m in imports("deepfusion")
           if m.startswith("diffnet.problems.") and m.split(".")[-1] in pdes]
    assert not bad, bad
    for path in (ROOT / "deepfusion").rglob("*.py"):
        src = path.read_text()
        assert "from diffnet.problems.burgers" not in src and "Burgers(" not in src, path
