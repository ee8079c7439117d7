"""Just enough of R's serialization format to read character vectors out of an R package's data
(the Jane Austen novels of Debian's ``r-cran-janeaustenr``), standard library only.

R writes objects in the XDR flavour of its serialization format (R Internals, "Serialization
Formats"): the header ``X\\n``, the format version (2 or 3), two R versions and, in version 3, the
native encoding; then each object as a 32-bit big-endian ``flags`` word whose low byte is the SEXP
type, bit 8 "is object", bit 9 "has attributes", bit 10 "has tag", followed by the type's payload.
A package's lazy-load database is two files: ``NAME.rdx``, a compressed serialized list
``(variables = list(name = c(offset, length)), references, compressed)``, and ``NAME.rdb``, the
concatenated blobs it points to, each a 4-byte big-endian uncompressed length, then (type-1
compression) one zlib stream holding a serialized object.

Read here: NULL, symbols, pairlists (attributes), character / logical / integer / double / list
vectors, references to earlier symbols and environments, and the ALTREP wrappers R 3.5+ may
write for strings (``wrap_string``, ``deferred_string``, ``compact_intseq``). Anything else raises
:class:`RDataError` naming the type: this is a reader for data, never for code (closures, bytecode
and environments' contents are not evaluated, only skipped where the format allows).
"""
from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional

NILSXP, SYMSXP, LISTSXP, ENVSXP, LANGSXP, CHARSXP = 0, 1, 2, 4, 6, 9
LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, VECSXP, EXPRSXP = 10, 13, 14, 15, 16, 19, 20
ALTREP, EMPTYENV, BASEENV, ATTRLISTSXP, ATTRLANGSXP = 238, 242, 241, 239, 240
NAMESPACESXP, PACKAGESXP, GLOBALENV, UNBOUNDVALUE, MISSINGARG, BASENAMESPACE = 249, 248, 253, 252, 251, 250
NILVALUE, REFSXP = 254, 255
NA_INT = -2**31


class RDataError(ValueError):
    """Not R serialization data this reader understands (named what and where)."""


class RList(list):
    """An R list / vector with its attributes (``names`` etc.) kept beside the values."""

    def __init__(self, values=(), attrs: Optional[Dict[str, Any]] = None):
        super().__init__(values)
        self.attrs = attrs or {}

    def as_dict(self) -> Dict[str, Any]:
        names = self.attrs.get("names")
        if names is None or len(names) != len(self):
            raise RDataError("an R list without names cannot be read as a dict")
        return dict(zip(names, self))


class _Sym(str):
    pass


class _Reader:
    def __init__(self, data: bytes, where: str):
        self.b, self.i, self.where, self.refs = data, 0, where, []

    def take(self, n: int) -> bytes:
        if self.i + n > len(self.b):
            raise RDataError(f"{self.where}: truncated at byte {self.i} (wanted {n} more)")
        out = self.b[self.i:self.i + n]
        self.i += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        if n < 0:
            raise RDataError(f"{self.where}: negative length {n} at byte {self.i}")
        return n

    def header(self) -> None:
        if self.take(2) != b"X\n":
            raise RDataError(f"{self.where}: not R XDR serialization (no 'X\\n' header)")
        version = self.int()
        self.int()
        self.int()
        if version == 3:
            self.take(self.int())
        elif version != 2:
            raise RDataError(f"{self.where}: serialization version {version}; allowed: 2, 3")

    def attributes(self, flags: int) -> Dict[str, Any]:
        if not flags & (1 << 9):
            return {}
        a = self.item()
        return a if isinstance(a, dict) else {}

    def pairlist(self, flags: int) -> Dict[str, Any]:
        """A pairlist read as {tag: value} (attributes, lists of arguments); untagged cells get '#i'."""
        out: Dict[str, Any] = {}
        while True:
            if flags & (1 << 9):
                self.item()                       # the cell's own attributes: unused
            tag = self.item() if flags & (1 << 10) else None
            out[str(tag) if tag is not None else f"#{len(out)}"] = self.item()
            flags = self.int()
            t = flags & 0xFF
            if t == NILVALUE:
                return out
            if t not in (LISTSXP, ATTRLISTSXP):
                # a dotted tail: keep it under a key of its own
                out["#tail"] = self.dispatch(flags)
                return out

    def item(self) -> Any:
        return self.dispatch(self.int())

    def dispatch(self, flags: int) -> Any:
        t = flags & 0xFF
        if t in (NILVALUE, NILSXP, EMPTYENV, BASEENV, GLOBALENV, UNBOUNDVALUE, MISSINGARG, BASENAMESPACE):
            return None
        if t == REFSXP:
            k = flags >> 8 or self.int()
            if not 1 <= k <= len(self.refs):
                raise RDataError(f"{self.where}: reference {k} to an object not read yet")
            return self.refs[k - 1]
        if t == SYMSXP:
            s = _Sym(self.item())
            self.refs.append(s)
            return s
        if t in (NAMESPACESXP, PACKAGESXP):
            self.int()                                 # 0, then a STRSXP-like payload of names
            vals = [self.item() for _ in range(self.length())]
            ref = f"<{'namespace' if t == NAMESPACESXP else 'package'} {vals}>"
            self.refs.append(ref)
            return ref
        if t == ENVSXP:
            self.int()                                 # locked
            ref = RList([], {"environment": True})
            self.refs.append(ref)
            for _ in range(4):                         # enclos, frame, hashtab, attributes: not kept
                self.item()
            return ref
        if t in (LISTSXP, ATTRLISTSXP, LANGSXP, ATTRLANGSXP):
            return self.pairlist(flags)
        if t == CHARSXP:
            n = self.int()
            if n == -1:
                return None                            # NA_character_
            return self.take(n).decode("utf-8", errors="replace")
        if t in (LGLSXP, INTSXP):
            n = self.length()
            vals = [None if v == NA_INT else v for v in struct.unpack(f">{n}i", self.take(4 * n))]
            if t == LGLSXP:
                vals = [None if v is None else bool(v) for v in vals]
            return RList(vals, self.attributes(flags))
        if t == REALSXP:
            n = self.length()
            return RList(struct.unpack(f">{n}d", self.take(8 * n)), self.attributes(flags))
        if t == CPLXSXP:
            n = self.length()
            v = struct.unpack(f">{2 * n}d", self.take(16 * n))
            return RList([complex(v[2 * i], v[2 * i + 1]) for i in range(n)], self.attributes(flags))
        if t in (STRSXP, VECSXP, EXPRSXP):
            n = self.length()
            vals = [self.item() for _ in range(n)]
            return RList(vals, self.attributes(flags))
        if t == ALTREP:
            return self.altrep()
        raise RDataError(f"{self.where}: R object type {t} at byte {self.i - 4} is not data this reader reads "
                         f"(strings, numbers, lists)")

    def altrep(self) -> Any:
        info = self.item()
        state = self.item()
        attrs = self.item()
        cls = str(list(info.values())[0]) if isinstance(info, dict) and info else "?"
        if cls in ("wrap_string", "wrap_integer", "wrap_real", "wrap_logical", "wrap_list"):
            payload = list(state.values())[0] if isinstance(state, dict) else state
            out = RList(list(payload), attrs if isinstance(attrs, dict) else {})
            return out
        if cls == "deferred_string":
            # state: (the numbers to print, their formatting info); the strings are their decimal form
            nums = list(state.values())[0] if isinstance(state, dict) else state
            return RList([None if v is None else (str(int(v)) if float(v).is_integer() else repr(float(v)))
                          for v in nums], attrs if isinstance(attrs, dict) else {})
        if cls == "compact_intseq":
            n, start, step = (int(x) for x in state)
            return RList([start + k * step for k in range(n)], attrs if isinstance(attrs, dict) else {})
        raise RDataError(f"{self.where}: ALTREP class {cls!r} is not read here")


def unserialize(data: bytes, where: str = "R data") -> Any:
    """One R object from its XDR serialization (see the module docstring for what is read)."""
    r = _Reader(data, where)
    r.header()
    return r.item()


def read_lazyload_db(base: Path) -> Dict[str, Any]:
    """{variable: object} of an R lazy-load database ``base.rdx`` + ``base.rdb`` (zlib blobs)."""
    base = Path(base)
    rdx, rdb = base.with_suffix(".rdx"), base.with_suffix(".rdb")
    for p in (rdx, rdb):
        if not p.is_file():
            raise FileNotFoundError(f"R lazy-load database: {p} not found")
    raw = rdx.read_bytes()
    try:
        idx_bytes = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else zlib.decompress(raw[4:])
    except (OSError, zlib.error) as e:
        raise RDataError(f"{rdx}: not a compressed R index ({e})") from None
    idx = unserialize(idx_bytes, str(rdx))
    if not isinstance(idx, RList):
        raise RDataError(f"{rdx}: the index is not an R list")
    variables = idx.as_dict().get("variables")
    if not isinstance(variables, RList):
        raise RDataError(f"{rdx}: the index has no 'variables' list")
    blob = rdb.read_bytes()
    out: Dict[str, Any] = {}
    for name, pos in variables.as_dict().items():
        off, ln = int(pos[0]), int(pos[1])
        if off < 0 or ln < 5 or off + ln > len(blob):
            raise RDataError(f"{rdb}: variable {name!r} at {off}+{ln} lies outside the file ({len(blob)} bytes)")
        piece = blob[off:off + ln]
        want = struct.unpack(">I", piece[:4])[0]
        try:
            data = zlib.decompress(piece[4:])
        except zlib.error as e:
            raise RDataError(f"{rdb}: variable {name!r} is not a zlib blob ({e}); only type-1 compression is read")
        if len(data) != want:
            raise RDataError(f"{rdb}: variable {name!r} decompressed to {len(data)} bytes, the blob says {want}")
        out[name] = unserialize(data, f"{rdb}:{name}")
    return out


def character_vector(obj: Any, what: str) -> List[str]:
    """The strings of an R character vector (NA as the empty string)."""
    if not isinstance(obj, RList) or not all(v is None or isinstance(v, str) for v in obj):
        raise RDataError(f"{what} is not an R character vector")
    return ["" if v is None else v for v in obj]
