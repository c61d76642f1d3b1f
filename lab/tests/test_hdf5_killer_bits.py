"""HDF5 itself crashes or loops on some single-bit flips of a checkpoint's metadata: the
reproduction behind the whole-file digest, and the contained check that refuses such files.

Kept in the lab, not the suite: the bits depend on the exact file layout of one h5py/HDF5
version, and telling a hang from a slow start needs a timeout."""
from tests.faults.bitflip import BAD
from tests.test_checkpoint_faults import run, sweep  # noqa: F401  (module fixture)


# Bits of the tiny run's newest checkpoint (as the sweep normalises it) that, in an unsealed
# copy parsed in the loading process, make HDF5 segfault (the first two) or loop (the last).
# Found with ``python -m tests.faults.bitflip --unsealed --uncontained --flips 3500``; another
# HDF5 version may lay the file out otherwise: then find new ones the same way.
HDF5_KILLERS = "1009225,2608202,2557563"


def test_the_contained_check_refuses_flips_that_hang_or_crash_hdf5(run, tmp_path):
    """The failure reproduced (the parse in the loading process crashes or hangs on these
    bits), and contained: the loader reads an unsealed file in a child first, and refuses."""
    bare = sweep(run, tmp_path, "--unsealed", "--uncontained", "--bits", HDF5_KILLERS,
                 "--check-seconds", "5", expect=1)
    assert bare["totals"]["crash"] + bare["totals"]["hang"] > 0, (
        "these bits no longer crash or hang the bare HDF5 parse: find new ones (see above)")
    report = sweep(run, tmp_path, "--unsealed", "--bits", HDF5_KILLERS, "--check-seconds", "5")
    assert report["totals"]["refused"] == 3 and not any(report["totals"][o] for o in BAD)
    assert report["contained_checks"] == 3


