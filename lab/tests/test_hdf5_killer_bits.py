"""Single-bit flips of an unsealed checkpoint that crash HDF5 when the file is parsed in the
loading process: the reproduction behind the whole-file digest, and the contained check (a child
process) that refuses such files; and a damaged list length, which the reader once took at its
word (building 2**62 names until it was killed) and now refuses.

The bits are found in the very file the sweep flips, by what HDF5's file format says the bytes
are, not by their offsets: a checkpoint that stores one more config field moves every structure
after it. Kept in the lab, not the suite: each crash costs the sweep a new worker, and telling a
loop from a slow start needs a timeout."""
import os
import struct

import h5py

from tests.faults.bitflip import BAD, STEP
from tests.faults.files import Regions, flip_bit, make_unsealed, normalised_copy
from tests.test_checkpoint_faults import run, sweep  # noqa: F401  (module fixture)

# The datatype message of a variable-length string (class 9, version 1; type 1 = string,
# null-terminated, UTF-8; 16 bytes an element). Bit 1 or 2 of its type field (the next byte)
# makes the type 3 or 5, which HDF5 does not define: parsing the attribute segfaults.
VLEN_STRING = bytes([0x19, 0x01, 0x01, 0x00, 0x10, 0x00, 0x00, 0x00])
# A list's length (the ``__len__`` attribute, an int64) grown by 2**62: a reader that names the
# members 0..n-1 before comparing their count loops (and grows) until it is killed.
LOOP_BIT = 62


def target(run, tmp_path) -> str:
    """The file the sweep flips: the run's newest checkpoint normalised, then unsealed."""
    path = str(tmp_path / "target.h5")
    normalised_copy(os.path.join(run, "checkpoints", STEP), path)
    make_unsealed(path, version=2)
    return path


def crash_bits(path) -> list[int]:
    """Bit 1 of the first variable-length string type in the metadata, bit 2 of the last."""
    data, regions = open(path, "rb").read(), Regions(path, sealed=False)
    found, at = [], data.find(VLEN_STRING)
    while at >= 0:
        if regions.of(at) == "metadata":
            found.append(at + 1)
        at = data.find(VLEN_STRING, at + 1)
    assert len(found) >= 2, f"no variable-length string types found in {path}"
    return [found[0] * 8 + 1, found[-1] * 8 + 2]


def loop_bit(path) -> int:
    """A bit of the first ``__len__`` attribute's value that adds 2**62 to it, found from the
    attribute message around the name (version 1: version, reserved, then the sizes of name,
    datatype and dataspace, each part padded to 8 bytes) and checked by reading it back."""
    data = open(path, "rb").read()
    name = data.index(b"__len__\x00")
    version, _, n_name, n_type, n_space = struct.unpack_from("<BBHHH", data, name - 8)
    assert version == 1 and n_name == len(b"__len__\x00"), "not a version-1 attribute message"
    value = name + sum(-(-n // 8) * 8 for n in (n_name, n_type, n_space))
    bit = value * 8 + LOOP_BIT
    before = lengths(path)
    flip_bit(path, bit)
    try:
        after = lengths(path)
    finally:
        flip_bit(path, bit)
    changed = {g: (before[g], n) for g, n in after.items() if n != before[g]}
    assert len(changed) == 1 and [n - m for m, n in changed.values()] == [2 ** LOOP_BIT], changed
    return bit


def lengths(path) -> dict:
    """Every stored list's ``__len__``, by group."""
    found = {}

    def visit(name, obj):
        if "__len__" in obj.attrs:
            found[name] = int(obj.attrs["__len__"])

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


def test_the_contained_check_refuses_flips_that_crash_hdf5_and_the_reader_a_damaged_length(
        run, tmp_path):
    """The failure reproduced (parsed in the loading process, the crash bits kill it), and
    contained: the loader reads the unsealed file in a child first, and refuses it, saying the
    reader crashed; HDF5 never parsed those bytes in the loading process. The length bit is
    refused by the reader's structure check in the loading process, once the child has read
    every object of the file."""
    path = target(run, tmp_path)
    crashes, loop = crash_bits(path), loop_bit(path)
    bare = sweep(run, tmp_path, "--unsealed", "--uncontained", "--check-seconds", "5",
                 "--bits", ",".join(map(str, crashes + [loop])), expect=1)
    assert bare["checkpoint"]["file"] == os.path.getsize(path)  # the file the bits were found in
    assert bare["bad_flips"] == {"silent": [], "unclear": [], "crash": sorted(crashes),
                                 "hang": []}, bare["bad_flips"]
    assert bare["refusals_by_check"] == {"structure check": 1}, bare
    # a crash is over at once: a long guard, so that a child slow to start is not taken for one
    # that hung
    report = sweep(run, tmp_path, "--unsealed", "--check-seconds", "120",
                   "--bits", ",".join(map(str, crashes + [loop])))
    assert report["refusals_by_check"] == {"contained check: crash": len(crashes),
                                           "structure check": 1}, report
    assert not any(report["totals"][o] for o in BAD)
    assert report["contained_checks"] == len(crashes) + 1
    # the child reads every HDF5 object (h5py only), the state's meaning is checked here: the
    # length bit passes the child (HDF5 reads it fine) and the loader's structure check refuses
    # it, on bytes the child has shown HDF5 parses without crashing or looping
    assert report["refused_after_hdf5_parsed_in_loader"] == 1
