"""The seeded single-bit-flip sweep over a checkpoint.

    python -m tests.faults.bitflip --flips 2000 --cli 10 --out sweep.json

trains a tiny run (``tests/tiny_configs.py``: checkpoints at steps 5 and 10), or takes ``--run
DIR``, and flips single bits of its newest checkpoint, drawn with ``--seed`` uniformly over every
bit of the file (re-saved with the run directory and elapsed time it records normalised, so a
bit number means the same place in the file whichever directory the run was trained in): the HDF5 metadata (superblock, object headers, B-trees, heaps, attributes, the
text of strings), the datasets' raw data (h5py's ``get_offset``/``get_storage_size``) and the
seal. Each flipped copy is loaded with ``load_checkpoint`` in a worker process and classified:

    refused    a CheckpointError, a clear message
    harmless   loaded, and identical to the undamaged file's state
    silent     loaded, but different (must be 0)
    unclear    another exception (must be 0)
    crash      the worker died (must be 0)
    hang       no answer within the hang guard; the worker is killed (must be 0)

Checking a seal is hashing, so a worker takes thousands of flips; after a crash or hang the
sweep goes on in a new worker from the next flip. Each record says whether HDF5 parsed the
flipped bytes in the loading process at all (it must not for a refused sealed file) and whether
the loader ran a contained check (a child process). ``--cli N`` also runs N flips (spread over
the regions) through the real commands, each in a copy of the run: ``deepfusion infer RUN_DIR``
and ``deepfusion train --resume RUN_DIR`` must fall back to step 5, saying why.

``--unsealed`` first turns the checkpoint into an earlier DeepFusion's (no seal, format version
2), to sweep the contained check; adding ``--uncontained`` runs that check inside the loading
process instead, which shows what the contained check is there for (flips that hang or crash
the HDF5 parse, or change names) and which bits those are: ``--bits B,B,...`` then sweeps just
those. ``--seal-bits`` adds every bit of the 92-byte seal, where few uniform flips land. Exit code 1 if any flip was silent, unclear, crashed or hung.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

from tests.faults.commands import PREVIOUS, STEP, cli_case, cli_sample, make_run
from tests.faults.files import Regions, make_unsealed, normalised_copy
from tests.faults.loader import fingerprint, run_flips

BAD = ("silent", "unclear", "crash", "hang")
OUTCOMES = ("refused", "harmless") + BAD
__all__ = ["BAD", "OUTCOMES", "PREVIOUS", "STEP", "fingerprint", "main", "make_run", "sweep"]


def reason(why: str) -> str:
    """A refusal, by the check that made it."""
    for key, words in (("seal: digest differs", "do not match the whole-file digest"),
                       ("seal: trailer damaged", "trailer after the HDF5 data"),
                       ("no seal (version 3)", "does not end with the whole-file digest"),
                       ("contained check: hang", "did not finish within"),
                       ("contained check: crash", "crashed the reader"),
                       ("contained check: exit", "the check exited with code"),
                       ("dataset digest", "recorded digest"),
                       ("structure check", "disagree (the structure was damaged)"),
                       ("not HDF5", "not a valid HDF5 file"),
                       ("not a checkpoint", "is not a DeepFusion checkpoint"),
                       ("HDF5 or decoding error", "Error: ")):
        if words in why:
            return key
    return "other"


def summarise(results: dict, regions: Regions) -> dict:
    table = {r: dict.fromkeys(OUTCOMES, 0) for r in ("metadata", "data", "seal")}
    reasons, parsed, contained = {}, 0, 0
    for bit, rec in results.items():
        table[regions.of(bit // 8)][rec["outcome"]] += 1
        if rec["outcome"] == "refused":
            reasons[reason(rec["why"])] = reasons.get(reason(rec["why"]), 0) + 1
            parsed += bool(rec.get("parsed"))
        contained += bool(rec.get("contained"))
    totals = {o: sum(t[o] for t in table.values()) for o in OUTCOMES}
    return {"by_region": table, "totals": totals, "refusals_by_check": reasons,
            "refused_after_hdf5_parsed_in_loader": parsed, "contained_checks": contained}


def sweep(args) -> dict:
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bitflip-")
    try:
        run = args.run or os.path.join(work, "run")
        if not args.run:
            make_run(run)
        target = os.path.join(work, "target.h5")
        normalised_copy(os.path.join(run, "checkpoints", STEP), target)
        if args.unsealed:
            make_unsealed(target, version=2)
        regions = Regions(target, sealed=not args.unsealed)
        rng = random.Random(args.seed)
        bits = ([int(b) for b in args.bits.split(",")] if args.bits else
                rng.sample(range(regions.size * 8), min(args.flips, regions.size * 8)))
        in_seal = sum(b >= regions.seal_start * 8 for b in bits)  # seeded flips in the seal
        if args.seal_bits:  # the seal is 92 bytes: few uniform flips land there
            bits += [b for b in range(regions.seal_start * 8, regions.size * 8) if b not in bits]
        guard = args.check_seconds + (0 if args.uncontained else 60)
        results = run_flips(target, bits, work, hang_guard=guard,
                            check_seconds=args.check_seconds, uncontained=args.uncontained)
        report = {"command": " ".join(["python -m tests.faults.bitflip"] + sys.argv[1:]),
                  "seed": args.seed, "flips": len(bits), "seeded_in_seal": in_seal,
                  "unsealed": args.unsealed,
                  "seal_bits": args.seal_bits,
                  "uncontained": args.uncontained,
                  "checkpoint": regions.sizes(), **summarise(results, regions)}
        report["example_messages"] = examples = {}
        for rec in results.values():
            if rec["outcome"] == "refused":
                examples.setdefault(reason(rec["why"]), rec["why"])
        report["bad_flips"] = {o: sorted(b for b, r in results.items() if r["outcome"] == o)
                               for o in BAD}
        cli_run = os.path.join(work, "run_target")  # the run, with the file swept as its newest
        shutil.copytree(run, cli_run)
        shutil.copyfile(target, os.path.join(cli_run, "checkpoints", STEP))
        report["cli"] = [cli_case(cli_run, b, work, args.cli_ranks, args.cli_timeout)
                         for b in cli_sample(regions, bits, args.cli)]
        report["seconds"] = round(time.perf_counter() - t0, 1)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bad_count(report: dict) -> int:
    n = sum(report["totals"][o] for o in BAD)
    return n + sum(v != "fell back, saying why" for c in report["cli"]
                   for k, v in c.items() if k != "bit")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.faults.bitflip", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flips", type=int, default=2000, help="single-bit flips (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run", help="a run directory with checkpoints at steps 5 and 10 "
                                  "(default: train a tiny one)")
    ap.add_argument("--cli", type=int, default=0, metavar="N",
                    help="also run N flips through deepfusion infer and train --resume")
    ap.add_argument("--cli-ranks", type=int, default=1, help="ranks of those commands")
    ap.add_argument("--cli-timeout", type=float, default=600.0, help="their hang guard (s)")
    ap.add_argument("--unsealed", action="store_true",
                    help="sweep an earlier DeepFusion's unsealed file (the contained check)")
    ap.add_argument("--uncontained", action="store_true",
                    help="with --unsealed: the check in the loading process, no child")
    ap.add_argument("--bits", help="flip these bits (comma-separated) instead of --flips")
    ap.add_argument("--seal-bits", action="store_true",
                    help="also flip every bit of the seal, one at a time")
    ap.add_argument("--check-seconds", type=float, default=60.0,
                    help="hang guard of a contained check (deepfusion.engine.checkpoint.contained.SECONDS)")
    ap.add_argument("--out", help="write the report (JSON) here")
    args = ap.parse_args(argv)
    report = sweep(args)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    return 1 if bad_count(report) else 0


if __name__ == "__main__":
    sys.exit(main())
