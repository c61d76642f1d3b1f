"""The configuration reference as Markdown (``deepfusion config --markdown``), made from the
schema itself: every section of :data:`SECTIONS` and the keys of a ``[[train.levels]]`` table,
each with its type, default, constraints and help text. docs/configuration.md holds a copy
between two marker lines, which a test keeps equal to this output; ``python -m
deepfusion.config.reference docs/configuration.md`` writes it there again. Pure Python.
"""
from __future__ import annotations

from deepfusion.config.levels import LevelConfig
from deepfusion.config.schema import key_rows
from deepfusion.config.sections import SECTIONS

BEGIN = "<!-- BEGIN deepfusion config --markdown -->"
END = "<!-- END deepfusion config --markdown -->"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict]) -> list[str]:
    out = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for r in rows:
        extra = f" ({r['constraints']})" if r["constraints"] else ""
        out.append(f"| `{r['key']}` | {r['type']} | `{_cell(r['default'])}` | "
                   f"{_cell(r['help'] + extra)} |")
    return out


def _intro(cls) -> str:
    """The section docstring's first line without its ``[name]:`` label, as a sentence."""
    line = (cls.__doc__ or "").strip().splitlines()[0]
    text = line.split("]:", 1)[1].strip() if line.startswith("[") and "]:" in line else line
    return text[:1].upper() + text[1:]


def markdown_reference() -> str:
    """Every key of every section as Markdown tables, one per section (``###`` headings)."""
    out = []
    for name, cls in SECTIONS.items():
        out += [f"### [{name}]", "", _intro(cls), ""] + _table(key_rows(name, cls)) + [""]
        if name == "train":
            out += ["#### [[train.levels]]", "",
                    "One table per level of a multigrid schedule (`train.levels`); the keys of "
                    "one level:", ""]
            out += _table(key_rows("train.levels[i]", LevelConfig)) + [""]
    return "\n".join(out).rstrip() + "\n"


def splice(page: str, generated: str) -> str:
    """``page`` with the text between its :data:`BEGIN` and :data:`END` lines replaced by
    ``generated`` (ValueError if the page lacks either line)."""
    lines = page.splitlines(keepends=True)
    try:
        a = next(i for i, s in enumerate(lines) if s.strip() == BEGIN)
        b = next(i for i, s in enumerate(lines) if s.strip() == END and i > a)
    except StopIteration:
        raise ValueError(f"the page has no {BEGIN!r} ... {END!r} lines") from None
    return "".join(lines[: a + 1]) + "\n" + generated + "\n" + "".join(lines[b:])


def between(page: str) -> str:
    """The text between the page's :data:`BEGIN` and :data:`END` lines, as :func:`splice`
    writes it (blank lines around the generated text)."""
    lines = page.splitlines(keepends=True)
    a = next(i for i, s in enumerate(lines) if s.strip() == BEGIN)
    b = next(i for i, s in enumerate(lines) if s.strip() == END and i > a)
    return "".join(lines[a + 1: b]).strip("\n") + "\n"


if __name__ == "__main__":  # python -m deepfusion.config.reference docs/configuration.md
    import sys

    for path in sys.argv[1:]:
        with open(path) as fh:
            text = splice(fh.read(), markdown_reference())
        with open(path, "w") as fh:
            fh.write(text)
        print(f"wrote the configuration reference into {path}")
