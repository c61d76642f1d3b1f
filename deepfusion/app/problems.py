"""``deepfusion problems [NAME] [--markdown]``: the registered problems and installed plugins,
or one problem (any name ``problem.name`` takes, e.g. ``package.module:ClassName``), and the
check of a config's problem and model options against the registries (``deepfusion config
FILE``).

Everything here is read from the registries (``diffnet.problems``: registered names, plugins'
entry points and ``module:Class`` paths; ``diffnet.generators.GENERATORS``): a problem's
options and their defaults from its
constructor's signature, one line on each from its docstring, its input channels, output,
dimension and reference methods from its class attributes (and a default instance, for the
axes and parameters, which some options decide). No problem is named here.
"""
from __future__ import annotations

import difflib
import inspect
import re
import sys
import textwrap

from deepfusion.config.schema import toml_value
from deepfusion.app.policy import run_local

# Options of every problem's constructor that the configuration sets elsewhere.
GRID = "grid"


def register(sub) -> None:
    p = sub.add_parser("problems", help="the registered problems and installed plugins: "
                                        "options, input channels, output, reference methods")
    p.add_argument("name", nargs="?", help="one problem, in detail (default: all, one line "
                                           "each): a registered name, a plugin's entry point, "
                                           "or package.module:ClassName")
    p.add_argument("--markdown", action="store_true",
                   help="print the reference of every problem (or of NAME) as Markdown")
    p.set_defaults(run=lambda args: run_local(cmd_problems, args))


def cmd_problems(args) -> int:
    from diffnet.problems import PROBLEMS, entry_point_names, resolve

    names = sorted(PROBLEMS) + [n for n in entry_point_names() if n not in PROBLEMS]
    if args.name is not None:
        resolve(args.name)   # ValueError: unknown, or a plugin that cannot be imported
    chosen = names if args.name is None else [args.name]
    if args.markdown:
        print(markdown(chosen), end="")
    elif args.name is None:
        print(listing(names), end="")
    else:
        print(detail(args.name), end="")
    return 0


# ---------------------------------------------------------------------------------------------
# what a problem is, read from the registry
# ---------------------------------------------------------------------------------------------

def facts(name: str) -> dict:
    """Everything ``problems`` prints about problem ``name`` (anything ``resolve`` takes)."""
    from diffnet.problems import has_reference, problem_spec, resolve, solves_from_inputs
    from diffnet.validation import keyword_options

    cls = resolve(name)
    doc = inspect.cleandoc(cls.__doc__ or "")
    options = keyword_options(cls).items()
    inst = cls()
    return {
        "name": name,
        "spec": problem_spec(cls),
        "source": "" if cls.__module__.split(".")[0] == "diffnet" else _where(cls),
        "summary": " ".join(doc.split("\n\n")[0].split()).replace("``", ""),
        "doc": doc,
        "dims": cls.dims,
        "axes": [(a.name, a.lo, a.hi) for a in inst.axes],
        "grid": list(inst.grid),
        "inputs": list(cls.input_channels),
        "fields_hint": cls.fields_hint.strip(),
        "output_channels": inst.output_channels,
        "params": list(inst.param_names),
        "methods": list(cls.reference_methods) if has_reference(cls) else [],
        "from_inputs": solves_from_inputs(cls),
        "options": [(k, _default(v), option_note(doc, k)) for k, v in options if k != GRID],
    }


def _where(cls) -> str:
    path = getattr(sys.modules.get(cls.__module__), "__file__", None) or "?"
    return f"{cls.__module__}:{cls.__qualname__} ({path})"


def _loadable(names) -> tuple[list[dict], list[str]]:
    """The facts of every problem that loads, and a line for each plugin that does not (a
    plugin's code may fail in any way: one broken plugin does not hide the others)."""
    rows, broken = [], []
    for n in names:
        try:
            rows.append(facts(n))
        except ValueError as e:
            broken.append(f"{n}: {e}")
        except Exception as e:  # noqa: BLE001 -- e.g. its default constructor fails
            broken.append(f"{n}: {type(e).__name__}: {e}")
    return rows, broken


def _default(value) -> str:
    if value is inspect.Parameter.empty:
        return "(required)"
    if value is None:
        return "(unset)"
    try:
        return toml_value(list(value) if isinstance(value, tuple) else value)
    except ValueError:
        return repr(value)


def option_note(doc: str, option: str, width: int = 160) -> str:
    """The docstring's sentence on ``option``: the first one that opens with ``option``
    (written ````option```` there), shortened to ``width`` characters; "" if none does."""
    text = " ".join(doc.split())
    for m in re.finditer(re.escape(f"``{option}``"), text):
        before = text[:m.start()].rstrip()
        if before and before[-1] not in ".:;":
            continue
        end = re.search(r"(?<!\.)\.(?=\s+[A-Z`(\"]|$)", text[m.start():])
        sentence = text[m.start(): m.start() + (end.end() if end else len(text))]
        sentence = sentence.replace("``", "").strip()
        return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."
    return ""


def _axes_text(f: dict) -> str:
    return ", ".join(f"{n} in [{lo:.4g}, {hi:.4g}]" for n, lo, hi in f["axes"])


def _params_text(f: dict) -> str:
    p = f["params"]
    shown = ", ".join(p[:4]) + (", ..." if len(p) > 4 else "")
    return f"{len(p)} per draw ({shown})"


def _hint(f: dict) -> str:
    return f" {f['fields_hint']}" if f["fields_hint"] else ""


def _methods_short(f: dict) -> str:
    return ", ".join(f["methods"]) or "none (no reference solver)"


def _methods_text(f: dict) -> str:
    if not f["methods"]:
        return ("none: no reference solver (it trains and infers; solve and compare refuse, "
                "evaluate reports the loss and its terms)")
    return (_methods_short(f) + "; from given fields (--inputs): "
            + ("yes" if f["from_inputs"] else "no, parameter vectors only"))


# ---------------------------------------------------------------------------------------------
# text and Markdown
# ---------------------------------------------------------------------------------------------

def listing(names) -> str:
    rows, broken = _loadable(names)
    w = max(len(f["name"]) for f in rows)
    out = []
    for f in rows:
        out.append(f"{f['name']:<{w}}  {f['dims']}-D  inputs: {', '.join(f['inputs'])}  "
                   f"reference methods: {_methods_short(f)}")
        if f["source"]:
            out.append(f"    plugin: {f['source']}")
        out.append(textwrap.fill(f["summary"], 96, initial_indent="    ",
                                 subsequent_indent="    "))
    for line in broken:
        out.append(f"(plugin that cannot be loaded) {line}")
    out.append("")
    out.append("deepfusion problems NAME: one problem's options and details; "
               "--markdown: the reference as Markdown; your own PDE: deepfusion problems "
               "package.module:ClassName (docs/your-own-pde.md)")
    return "\n".join(out) + "\n"


def detail(name: str) -> str:
    f = facts(name)
    lines = [f"{name}: {f['summary']}", ""]
    if f["source"]:
        lines += [f"  class:              {f['source']}",
                  f"  checkpoints record: {f['spec']!r} (how a new process finds it again)"]
    lines += [
             f"  dimension:          {f['dims']}-D, axes {_axes_text(f)}; default grid "
             f"{'x'.join(map(str, f['grid']))} (problem.grid, --grid)",
             f"  input channels:     {', '.join(f['inputs'])}{_hint(f)}",
             f"  output:             the solution u on the grid; the network outputs "
             f"{f['output_channels']} field(s) with the default options",
             f"  parameters:         {_params_text(f)} with the default options",
             f"  reference methods:  {_methods_text(f)}",
             "",
             "  options (problem.options.KEY in a config, --set problem.options.KEY=VALUE):"]
    w = max([len(k) for k, _, _ in f["options"]] + [1])
    for k, default, _note in f["options"]:
        lines.append(f"    {k:<{w}} = {default}")
    lines += ["", "Description:", textwrap.indent(f["doc"], "  ")]
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(names) -> str:
    rows, _broken = _loadable(names)
    out = ["| Problem | Dimension | Input channels | Reference methods | Equation |",
           "|---|---|---|---|---|"]
    for f in rows:
        out.append(f"| [`{f['name']}`](#{f['name']}) | {f['dims']}-D | "
                   f"{', '.join(f'`{c}`' for c in f['inputs'])} | "
                   f"{_methods_short(f)} | {_cell(f['summary'])} |")
    for f in rows:
        out += ["", f"### {f['name']}", "", _cell(f["summary"]), "",
                f"- Dimension: {f['dims']}-D, axes {_axes_text(f)}; default grid "
                f"`{list(f['grid'])}` (`problem.grid`, `--grid`).",
                f"- Input channels: {', '.join(f'`{c}`' for c in f['inputs'])}"
                f"{_hint(f)}.",
                f"- Output: the solution `u` on the grid; the network outputs "
                f"{f['output_channels']} field(s) with the default options.",
                f"- Parameters: {_params_text(f)} with the default options.",
                f"- Reference methods: {_methods_text(f)}.",
                "", "| Option | Default | Note (from the docstring; `deepfusion problems NAME` "
                "prints it whole) |", "|---|---|---|"]
        for k, default, note in f["options"]:
            out.append(f"| `{k}` | `{_cell(default)}` | {_cell(note)} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# deepfusion config FILE: the options against the registries
# ---------------------------------------------------------------------------------------------

def check_registry_options(cfg) -> list[str]:
    """ValueError if ``problem.name``, ``problem.options``, ``model.name`` or ``model.options``
    name something the registries do not have (no problem or model is built); the notes to
    print (a config without ``problem.name``)."""
    from diffnet.generators import GENERATORS
    from diffnet.problems import available_text, option_names, resolve
    from diffnet.validation import keyword_options

    notes = []
    if not cfg.problem.name:
        notes.append(f"problem.name is not set: 'deepfusion train' needs one; "
                     f"{available_text()} (deepfusion problems)")
    else:
        try:
            cls = resolve(cfg.problem.name)
        except ValueError as e:
            raise ValueError(f"problem.name: {e}") from None
        valid = [k for k in option_names(cls) if k != GRID]
        for key in cfg.problem.options:
            _known(f"problem.options.{key}", key, valid,
                   f"options of problem {cfg.problem.name!r}", option=True)
    _known("model.name", cfg.model.name, sorted(GENERATORS), "registered models")
    valid = list(keyword_options(GENERATORS[cfg.model.name]))
    for key in cfg.model.options:
        _known(f"model.options.{key}", key, valid, f"options of model {cfg.model.name!r}",
               option=True)
    return notes


def _known(key: str, value: str, valid, what: str, option: bool = False) -> None:
    if value in valid:
        return
    hint = difflib.get_close_matches(value, valid, n=1)
    shown = f"unknown key {key!r}" if option else f"{key} = {value!r} is unknown"
    raise ValueError(f"{shown}{f'; did you mean {hint[0]!r}?' if hint else ''} "
                     f"({what}: {', '.join(valid)})")
