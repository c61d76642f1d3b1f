"""The manual is kept true: README.md and every page of docs/.

* Every docs/ page opens with its title and, within a few lines, an example in a code block.
* Every ``deepfusion ...`` command line written in a shell block (after a launcher such as
  ``mpiexec -n 2``, ``srun`` or ``ibrun``, or environment assignments) parses with the real
  command-line parser, so a renamed or removed flag fails here and not in a user's terminal.
* A block right after the line ``<!-- test: run -->`` runs: shell blocks with ``bash -e``, Python
  blocks with this interpreter, each in a fresh directory where ``configs``, ``examples`` and
  ``lab`` are the repository's and the virtual environment's ``bin`` comes first on PATH. Only
  cheap blocks are marked; the others are parsed, not run. A plain ``deepfusion`` of a block
  and a Python block run in a fork of one process that has imported torch and the package
  (``tests/warm_cli.py``), not in a fresh interpreter each; ``mpiexec``'s ranks start fresh.
  A block after ``<!-- test: run full -->`` runs in ``make test-full`` (marker ``full``): the
  longer examples of a page whose quicker one runs in ``make test``.
* Relative links and images resolve to files of the repository.
* The README stays a front page: at most 300 lines, no dates, rounds or issue numbers.
"""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tests.warm_cli import WarmServer

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [ROOT / "README.md"] + PAGES
RUN_MARK = "<!-- test: run -->"
FULL_RUN_MARK = "<!-- test: run full -->"
SHELLS = ("sh", "bash", "console", "shell")
LAUNCHERS = {"mpiexec", "mpirun", "srun", "ibrun", "nohup", "time", "$", "exec"}
HANG_GUARD = 300  # seconds; a hang guard for the suite, never an assertion about speed


def blocks(path: pathlib.Path):
    """(language, first line number, text, run mark or None) of every fenced block of a page."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)", lines[i])
        if not m:
            i += 1
            continue
        start, lang, body = i, m.group(2), []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        mark = lines[start - 1].strip() if start > 0 else ""
        marked = mark if mark in (RUN_MARK, FULL_RUN_MARK) else None
        yield lang, start + 1, "\n".join(body), marked
        i += 1


def logical_lines(text: str):
    """Shell lines with backslash continuations joined and prompts ('$ ') removed."""
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if line and not line.startswith("#"):
            yield line


def deepfusion_argv(line: str):
    """The arguments of the ``deepfusion`` command on a shell line, or None when the line runs
    something else or is a synopsis (``[--flag ...]``, ``...``) rather than a command."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:
        return None
    for j, tok in enumerate(tokens):
        if os.path.basename(tok) == "deepfusion" or (tok == "-m" and j and tokens[j - 1].endswith("python")
                                                     and j + 1 < len(tokens) and tokens[j + 1] == "deepfusion"):
            before, start = tokens[:j], j + 1 if tok != "-m" else j + 2
            break
    else:
        return None
    if tok == "-m":
        before = before[:-1]
    if not all(t in LAUNCHERS or "=" in t or t.startswith("-") or t.isdigit() or t.startswith("$")
               for t in before):
        return None
    argv = []
    for t in tokens[start:]:
        if t in ("|", "||", "&", "&&", ";", ">", ">>", "<", "2>", "2>&1") or re.fullmatch(r"[|&;<>]+", t):
            break
        argv.append(t)
    if any(t == "..." or t.startswith("[") or t.endswith("]...") for t in argv):
        return None
    return argv


def commands():
    for path in DOCUMENTS:
        for lang, line_no, text, _ in blocks(path):
            if lang in SHELLS:
                for line in logical_lines(text):
                    argv = deepfusion_argv(line)
                    if argv is not None:
                        yield pytest.param(argv, id=f"{path.relative_to(ROOT)}:{line_no}:{' '.join(argv[:2])}")


def parse(argv: list[str]) -> None:
    """Parse like the real command line, down into the job tools' own parsers."""
    from deepfusion.cli import build_parser

    args = build_parser().parse_args(argv)
    if getattr(args, "cmd", None) == "launch":  # the command every rank runs parses too
        from deepfusion.app.launch import command_of

        parse(command_of(args))
    if getattr(args, "cmd", None) == "jobs":
        import importlib

        tool = importlib.import_module(f"deepfusion.jobs.{args.tool}")
        tool.build_parser().parse_args(args.rest)


def test_the_manual_has_its_pages():
    assert PAGES, "docs/ holds the manual"
    assert (ROOT / "docs" / "index.md").exists()


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_every_page_opens_with_an_example(path):
    lines = path.read_text().splitlines()
    assert lines and lines[0].startswith("# "), f"{path.name}: the first line is the page's title"
    assert any(line.lstrip().startswith("```") for line in lines[1:13]), (
        f"{path.name}: open with something that runs (a code block within the first 12 lines)")


@pytest.mark.parametrize("argv", list(commands()))
def test_every_command_in_the_manual_parses(argv, capsys):
    try:
        parse(argv)
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 0, f"`deepfusion {' '.join(argv)}` does not parse:\n{err}"


def test_the_command_finder_sees_launchers_and_skips_synopses():
    assert deepfusion_argv("mpiexec -n 2 deepfusion train configs/demo.toml") == ["train", "configs/demo.toml"]
    assert deepfusion_argv("OMP_NUM_THREADS=1 srun .venv/bin/deepfusion infer R --samples 2 | tail") == [
        "infer", "R", "--samples", "2"]
    assert deepfusion_argv("python -m deepfusion config X > out.txt") == ["config", "X"]
    assert deepfusion_argv("deepfusion train CONFIG [--set KEY=VALUE ...]") is None
    assert deepfusion_argv("pip install deepfusion") is None
    with pytest.raises(AssertionError):
        test_every_command_in_the_manual_parses(["train", "--no-such-flag"], _Capture())
    with pytest.raises(AssertionError):  # under deepfusion launch too
        test_every_command_in_the_manual_parses(["launch", "-n", "2", "--", "train", "--no-such"],
                                                _Capture())


class _Capture:
    def readouterr(self):
        return type("R", (), {"err": ""})()


def marked_blocks():
    for path in DOCUMENTS:
        for lang, line_no, text, marked in blocks(path):
            if marked:
                yield pytest.param(lang, text, id=f"{path.relative_to(ROOT)}:{line_no}",
                                   marks=[pytest.mark.full] if marked == FULL_RUN_MARK else [])


def example_env() -> dict:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DEEPFUSION_NO_MPI", None)
    return env


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    with WarmServer(tmp_path_factory.mktemp("warm"), example_env()) as server:
        yield server


@pytest.mark.parametrize("lang, text", list(marked_blocks()))
def test_marked_examples_run(lang, text, tmp_path, warm):
    for name in ("configs", "examples", "lab"):
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    env = warm.env(example_env())
    if lang in SHELLS:
        cmd = ["bash", "-e", "-c", "\n".join(line[2:] if line.startswith("$ ") else line
                                                for line in text.splitlines())]
    elif lang == "python":
        cmd = warm.python_argv(text)
    else:
        pytest.fail(f"a block marked {RUN_MARK} must be sh/bash/console or python, not {lang!r}")
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#")[0]
        if file and not (path.parent / file).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: links to missing files: {broken}"


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    history = [m.group(0) for m in re.finditer(
        r"\b20\d\d-\d\d-\d\d\b|\bround \d+|(?<![\w&])#\d+\b|\bissue \d+", text, flags=re.I)]
    assert not history, f"the README is a user's front page; history belongs in lab/: {history}"


def test_the_problems_page_names_every_option_of_every_registered_problem():
    from diffnet.problems import PROBLEMS, option_names

    page = (ROOT / "docs" / "problems.md").read_text()
    missing = [(name, opt) for name in PROBLEMS for opt in option_names(name)
               if f"`{opt}`" not in page]
    assert not missing, f"docs/problems.md does not describe these options: {missing}"
