"""The flags ``evaluate``, ``infer`` and ``solve`` share: ``--set problem.options.KEY=VALUE``,
``--threads`` and (the commands that answer from a checkpoint) ``--correction``.

``--set`` reads its VALUE as TOML, with the parser of ``deepfusion train --set``
(:func:`deepfusion.config.apply_overrides`), and on these commands takes only the keys of the
run's ``[problem.options]`` table. Kept light: no torch, no PDE.
"""
from __future__ import annotations

from deepfusion.config import apply_overrides
from deepfusion.config.files import PROBLEM_OPTIONS


SET_HELP = ("a problem option, problem.options.KEY=VALUE, VALUE in TOML as in 'deepfusion "
            "train --set' (repeatable; 'deepfusion problems NAME' lists a problem's options)")
ANSWER_SET_HELP = (SET_HELP + ": replaces the checkpoint's option KEY (as in the "
                   "[problem.options] table of the run's config.toml), e.g. "
                   "problem.options.ritz_partition=2 changes how the answer is formed from the "
                   "network's output; refused if it changes the channels the network was "
                   "built for")
SOLVE_SET_HELP = (SET_HELP + ", e.g. problem.options.n_terms=6, "
                  "problem.options.omega_range=[-2, 2], problem.options.family=fine-scale")
THREADS_HELP = ("threads per rank (default 0 = auto: the host's cores / ranks); --threads 1 "
                "makes infer's output bytes identical for any number of ranks (more threads "
                "are faster but change the last float32 bits of predictions)")


def add_set(p, help_text: str) -> None:
    """``--set problem.options.KEY=VALUE`` (repeatable)."""
    p.add_argument("--set", action="append", metavar="problem.options.KEY=VALUE", help=help_text)


CORRECTION_HELP = ("cells per axis of the answers' coarse correction (the training loss "
                   "minimised over their rescalings and a coarse partition's hats, "
                   "docs/coarse-correction.md); 0 = none; default: the run's problem.correction")


def add_correction(p) -> None:
    p.add_argument("--correction", type=int, default=None, metavar="M", help=CORRECTION_HELP)


def correction_of(given, loaded, problem, flag: str = "--correction") -> int:
    """The coarse correction to answer with: ``given`` (the command's ``flag``) if not None,
    else the checkpoint's (``loaded.correction``). ValueError for a negative one, and for cells
    the ``problem``'s grid cannot hold or a loss that is not quadratic (tried on one answer:
    before the work, not in the middle of it)."""
    m = loaded.correction if given is None else given
    if int(m) < 0:
        raise ValueError(f"{flag} must be >= 0 (cells per axis; 0 = none), got {m}")
    if m:
        from diffnet.problems import check_correction

        try:
            check_correction(problem, int(m))
        except ValueError as e:
            raise ValueError(f"{flag} {m}: {e}") from None
    return int(m)


def add_threads(p) -> None:
    p.add_argument("--threads", type=int, default=0, metavar="T", help=THREADS_HELP)


def set_options(items, command: str) -> dict:
    """The ``--set problem.options.KEY=VALUE`` items -> {KEY: value} (VALUE parsed as TOML, a
    dotted KEY below it makes a nested table). ValueError for any other key, naming the ones
    accepted."""
    for item in items or []:
        key = str(item).partition("=")[0].strip()
        if not key.startswith(PROBLEM_OPTIONS) or key == PROBLEM_OPTIONS or "=" not in str(item):
            raise ValueError(
                f"--set {item}: {command} takes only problem options, --set "
                f"problem.options.KEY=VALUE (KEY as in the [problem.options] table of the run's "
                f"config.toml; VALUE in TOML){_GRID_HINT if key.endswith('grid') else ''}")
    raw = apply_overrides({}, list(items or []))
    return dict(raw.get("problem", {}).get("options", {}))


_GRID_HINT = "; the grid is --grid HxW"


def problem_options(args, command: str) -> dict:
    """The problem options of the command's ``--set`` flags: {KEY: value}."""
    return set_options(args.set, command)
