"""qatfactory/_rdata.py, the reader of R's serialization that takes Jane Austen's novels out of Debian's
r-cran-janeaustenr: objects written byte by byte here from R Internals' description of the XDR format,
a lazy-load database assembled by hand, bad input named, and the real package against the sizes
recorded in shared/reference/environment.md (6 novels, 3,951,606 characters in their lines)."""
from __future__ import annotations

import gzip
import struct
import zlib

import pytest

from qatfactory import _rdata as R


def i32(*v):
    return b"".join(struct.pack(">i", x) for x in v)


def header(version=3):
    h = b"X\n" + i32(version, 0x040201, 0x030500)
    return h + (i32(5) + b"UTF-8" if version == 3 else b"")


def charsxp(s):
    if s is None:
        return i32(9, -1)
    b = s.encode()
    return i32(9 | (1 << 15), len(b)) + b      # bit 15: the UTF-8 encoding level flag R sets


def strsxp(items, names=None):
    flags = 16 | ((1 << 9) if names else 0)
    out = i32(flags, len(items)) + b"".join(charsxp(s) for s in items)
    if names:
        out += attrs_names(names)
    return out


def attrs_names(names):
    # pairlist cell with a tag: flags LISTSXP | has-tag, the tag SYMSXP("names"), the value, then NILVALUE
    return i32(2 | (1 << 10)) + i32(1) + charsxp("names") + strsxp(names) + i32(254)


def test_character_vector_with_na_and_version_2():
    obj = R.unserialize(header(2) + strsxp(["a", None, "héllo"]))
    assert list(obj) == ["a", None, "héllo"]
    assert R.character_vector(obj, "x") == ["a", "", "héllo"]


def test_named_list_of_vectors_and_symbol_reference():
    ints = i32(13, 3, 1, -2**31, 7)
    reals = i32(14, 2) + struct.pack(">2d", 1.5, -0.25)
    # a list with a names attribute; a second names attribute refers back to the symbol (REFSXP, index 1)
    body = i32(19 | (1 << 9), 2) + ints + reals + attrs_names(["i", "r"])
    obj = R.unserialize(header() + body)
    d = obj.as_dict()
    assert list(d["i"]) == [1, None, 7] and list(d["r"]) == [1.5, -0.25]
    ref = i32(19 | (1 << 9), 1) + ints + i32(2 | (1 << 10)) + i32(255 | (1 << 8)) + strsxp(["j"]) + i32(254)
    both = i32(19, 2) + body + ref
    obj2 = R.unserialize(header() + both)
    assert list(obj2[1].as_dict()) == ["j"]


def test_bad_input_is_named():
    with pytest.raises(R.RDataError, match="no 'X"):
        R.unserialize(b"A\n" + i32(2, 0, 0))
    with pytest.raises(R.RDataError, match="truncated"):
        R.unserialize(header() + i32(16, 3) + charsxp("a"))
    with pytest.raises(R.RDataError, match="type 3"):          # a closure: code, not data
        R.unserialize(header() + i32(3))
    with pytest.raises(R.RDataError, match="not an R character vector"):
        R.character_vector(R.unserialize(header() + i32(13, 1, 5)), "ints")


def test_lazyload_db_built_by_hand(tmp_path):
    blobs = {"alpha": header() + strsxp(["x", "y"]), "beta": header() + strsxp(["z"])}
    rdb, pos = b"", {}
    for k, raw in blobs.items():
        piece = struct.pack(">I", len(raw)) + zlib.compress(raw)
        pos[k] = (len(rdb), len(piece))
        rdb += piece
    pairs = b"".join(i32(13, 2, *pos[k]) for k in blobs)
    variables = i32(19 | (1 << 9), len(blobs)) + pairs + attrs_names(list(blobs))
    idx = i32(19 | (1 << 9), 1) + variables + attrs_names(["variables"])
    (tmp_path / "db.rdx").write_bytes(gzip.compress(header() + idx))
    (tmp_path / "db.rdb").write_bytes(rdb)
    got = R.read_lazyload_db(tmp_path / "db")
    assert {k: list(v) for k, v in got.items()} == {"alpha": ["x", "y"], "beta": ["z"]}
    (tmp_path / "db.rdb").write_bytes(rdb[:-3])                  # the last blob cut short
    with pytest.raises(R.RDataError, match="outside the file"):
        R.read_lazyload_db(tmp_path / "db")
    with pytest.raises(FileNotFoundError, match="nope.rdx"):
        R.read_lazyload_db(tmp_path / "nope")


def test_austen_from_the_debian_package():
    from qatfactory import assets
    nov = assets.austen_novels()
    assert sorted(nov) == ["emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
                           "sensesensibility"]
    # environment.md: 3.95 M characters in the lines (newlines between lines not counted)
    assert sum(len(t) - t.count("\n") for t in nov.values()) == 3_951_606
    assert nov["persuasion"].startswith("Persuasion") and "Anne Elliot" in nov["persuasion"]
    assert nov["prideprejudice"].count("Elizabeth") > 500
    pr = assets.provenance("austen")
    assert pr["package"] == "r-cran-janeaustenr=1.0.0-1" and len(pr["deb_sha256"]) == 64
    assert pr["file_sha256"] == assets.sha256_file(assets.fetch("austen"))
