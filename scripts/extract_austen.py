#!/usr/bin/env python3
"""Extract Jane Austen's six novels from Debian's ``r-cran-janeaustenr`` package into gzipped UTF-8 text files.

The package ships the novels as an R lazy-load database (``data/Rdata.rdx`` + ``data/Rdata.rdb``): the ``.rdx`` is a
gzipped serialized R list that maps each object name to an (offset, length) slice of the ``.rdb``, and each slice is
a 4-byte big-endian length followed by a zlib stream holding one serialized R object (here a character vector, one
element per line of the Project Gutenberg text). This script reads that format with the standard library only:
no R is needed.

Usage (from the repository root)::

    python scripts/extract_austen.py                      # runs `apt-get download r-cran-janeaustenr` in a temp dir
    python scripts/extract_austen.py --deb r-cran-janeaustenr_1.0.0-1_all.deb
    python scripts/extract_austen.py --dir /usr/lib/R/site-library/janeaustenr

Output: ``data/austen/<novel>.txt.gz`` for the training novels and ``data/austen/val/persuasion.txt.gz`` (held out).
The gzip files carry no name or timestamp, so a rerun writes identical bytes.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import io
import lzma
import struct
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
VAL_NOVELS = ("persuasion",)
DEB_DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"
REPO_ROOT = Path(__file__).resolve().parents[1]

# SEXP types (R internals, serialize.c).
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, DOTSXP = 9, 10, 13, 14, 15, 16, 17
VECSXP, EXPRSXP, RAWSXP, S4SXP = 19, 20, 24, 25
ALTREP_SXP, ATTRLISTSXP, ATTRLANGSXP = 238, 239, 240
BASEENV_SXP, EMPTYENV_SXP, PERSISTSXP, PACKAGESXP, NAMESPACESXP = 241, 242, 247, 248, 249
BASENAMESPACE_SXP, MISSINGARG_SXP, UNBOUNDVALUE_SXP, GLOBALENV_SXP, NILVALUE_SXP, REFSXP = 250, 251, 252, 253, 254, 255
PAIRLISTS = {LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLISTSXP, ATTRLANGSXP}
SPECIAL_VALUES = {BASEENV_SXP, EMPTYENV_SXP, BASENAMESPACE_SXP, MISSINGARG_SXP, UNBOUNDVALUE_SXP, GLOBALENV_SXP}
LATIN1_MASK, UTF8_MASK, BYTES_MASK = 1 << 2, 1 << 3, 1 << 1


class RObject:
    """A decoded R object: its SEXP type, its value and its attributes (a dict of name -> object)."""

    def __init__(self, sexptype: int, value: Any, attributes: dict[str, Any] | None = None) -> None:
        self.sexptype = sexptype
        self.value = value
        self.attributes = attributes or {}

    def __repr__(self) -> str:
        return f"RObject(type={self.sexptype}, value={self.value!r:.60}, attributes={list(self.attributes)})"


class RUnserializer:
    """Reads R's XDR serialization format (versions 2 and 3) far enough for data objects: vectors, lists, pairlists,
    symbols, environments (as opaque references) and ALTREP wrappers."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError(f"not an XDR-format R serialization (header {data[:2]!r})")
        self.buf = io.BytesIO(data[2:])
        self.refs: list[Any] = []
        version = self.read_int()
        self.read_int()  # writer R version
        self.read_int()  # minimal reader R version
        if version == 3:
            self.buf.read(self.read_int())  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def read_int(self) -> int:
        """One big-endian int32."""
        return int(struct.unpack(">i", self.buf.read(4))[0])

    def length(self) -> int:
        """A vector length (int32, or -1 followed by two int32 halves for long vectors)."""
        n = self.read_int()
        if n == -1:
            hi, lo = self.read_int(), self.read_int()
            n = (hi << 32) + lo
        return n

    def read(self) -> Any:
        """The next object in the stream."""
        flags = self.read_int()
        sexptype, levels = flags & 0xFF, flags >> 12
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if sexptype == NILVALUE_SXP:
            return None
        if sexptype in SPECIAL_VALUES:
            return RObject(sexptype, None)
        if sexptype == REFSXP:
            index = flags >> 8 or self.read_int()
            return self.refs[index - 1]
        if sexptype in (PERSISTSXP, PACKAGESXP, NAMESPACESXP):
            return self.persistent(sexptype)
        if sexptype == SYMSXP:
            symbol = RObject(SYMSXP, self.read().value)
            self.refs.append(symbol)
            return symbol
        if sexptype == ENVSXP:
            return self.environment()
        if sexptype in PAIRLISTS:
            return self.pairlist(sexptype, has_attr, has_tag)
        if sexptype == ALTREP_SXP:
            return self.altrep()
        if sexptype == CHARSXP:
            return RObject(CHARSXP, self.charsxp(levels))
        return self.vector(sexptype, has_attr)

    def persistent(self, sexptype: int) -> RObject:
        """A package/namespace/persistent name: a string vector, registered as a reference."""
        if self.read_int() != 0:
            raise ValueError("unexpected persistent-name format")
        names = [self.read().value for _ in range(self.read_int())]
        obj = RObject(sexptype, names)
        self.refs.append(obj)
        return obj

    def environment(self) -> RObject:
        """An environment: registered first (it may refer to itself), then enclosure, frame, hash table, attributes."""
        env = RObject(ENVSXP, None)
        self.refs.append(env)
        self.read_int()  # locked
        enclosure, frame, hashtab, attributes = self.read(), self.read(), self.read(), self.read()
        env.value = {"enclosure": enclosure, "frame": frame, "hashtab": hashtab}
        env.attributes = _attributes(attributes)
        return env

    def pairlist(self, sexptype: int, has_attr: bool, has_tag: bool) -> RObject:
        """A pairlist (or call/closure/promise): a chain of (tag, car) cells, read iteratively along the cdr."""
        attributes = self.read() if has_attr else None
        cells: list[tuple[Any, Any]] = []
        while True:
            tag = self.read() if has_tag else None
            cells.append((tag.value if isinstance(tag, RObject) else None, self.read()))
            flags = self.read_int()
            if flags & 0xFF not in PAIRLISTS:
                self.buf.seek(-4, io.SEEK_CUR)
                tail = self.read()
                break
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
            if has_attr:
                self.read()  # attributes of an inner cell: not needed for data
        obj = RObject(sexptype, cells, _attributes(attributes))
        if tail is not None:
            obj.attributes["__tail__"] = tail
        return obj

    def altrep(self) -> RObject:
        """An ALTREP object: (class info, state, attributes); compact sequences and wrappers are expanded."""
        info, state, attributes = self.read(), self.read(), self.read()
        cls = info.value[0][1].value if isinstance(info, RObject) and info.value else ""
        if cls == "compact_intseq":
            n, start, step = (int(x) for x in state.value)
            return RObject(INTSXP, list(range(start, start + n * step, step)), _attributes(attributes))
        if cls == "compact_realseq":
            n, start, step = state.value
            return RObject(REALSXP, [start + i * step for i in range(int(n))], _attributes(attributes))
        if cls.startswith("wrap_"):
            inner = state.value[0][1]
            return RObject(inner.sexptype, inner.value, _attributes(attributes) or inner.attributes)
        if cls == "deferred_string":
            inner = state.value[0][1]
            return RObject(STRSXP, [str(x) for x in inner.value], _attributes(attributes))
        raise ValueError(f"unsupported ALTREP class {cls!r}")

    def charsxp(self, levels: int) -> str | None:
        """A CHARSXP: length (-1 is NA) then bytes in the encoding its levels name."""
        n = self.read_int()
        if n == -1:
            return None
        raw = self.buf.read(n)
        if levels & LATIN1_MASK:
            return raw.decode("latin-1")
        if levels & BYTES_MASK:
            return raw.decode("utf-8", errors="surrogateescape")
        return raw.decode("utf-8")

    def vector(self, sexptype: int, has_attr: bool) -> RObject:
        """An atomic vector or a generic list, followed by its attributes."""
        n = self.length()
        value: Any
        if sexptype == STRSXP:
            value = [self.read().value for _ in range(n)]
        elif sexptype in (VECSXP, EXPRSXP):
            value = [self.read() for _ in range(n)]
        elif sexptype in (LGLSXP, INTSXP):
            value = list(struct.unpack(f">{n}i", self.buf.read(4 * n)))
        elif sexptype == REALSXP:
            value = list(struct.unpack(f">{n}d", self.buf.read(8 * n)))
        elif sexptype == CPLXSXP:
            parts = struct.unpack(f">{2 * n}d", self.buf.read(16 * n))
            value = [complex(parts[i], parts[i + 1]) for i in range(0, 2 * n, 2)]
        elif sexptype == RAWSXP:
            value = self.buf.read(n)
        elif sexptype == S4SXP:
            value = None
            n = 0
        else:
            raise ValueError(f"unsupported SEXP type {sexptype}")
        return RObject(sexptype, value, _attributes(self.read()) if has_attr else None)


def _attributes(pairlist: Any) -> dict[str, Any]:
    """Attributes pairlist -> {name: object}."""
    if not isinstance(pairlist, RObject) or pairlist.sexptype not in PAIRLISTS:
        return {}
    return {tag: value for tag, value in pairlist.value}


def unserialize(data: bytes) -> Any:
    """Decode one serialized R object."""
    return RUnserializer(data).read()


def named_list(obj: RObject) -> dict[str, Any]:
    """An R named list (VECSXP with a names attribute) -> dict."""
    return dict(zip(obj.attributes["names"].value, obj.value, strict=True))


def lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, Any]:
    """Every variable of an R lazy-load database, decoded: {name: RObject}."""
    index = named_list(unserialize(_maybe_gunzip(rdx)))
    compressed = index.get("compressed")
    kind = int(compressed.value[0]) if isinstance(compressed, RObject) else 1
    variables = named_list(index["variables"])
    result = {}
    for name, slot in variables.items():
        offset, size = (int(x) for x in slot.value)
        result[name] = unserialize(_decompress(rdb[offset : offset + size], kind))
    return result


def _maybe_gunzip(data: bytes) -> bytes:
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def _decompress(blob: bytes, kind: int) -> bytes:
    """One .rdb record: 4-byte big-endian length, then zlib (kind 1), or a type byte and a stream (kinds 2, 3)."""
    expected = struct.unpack(">I", blob[:4])[0]
    if kind == 1:
        out = zlib.decompress(blob[4:])
    else:
        method, payload = blob[4:5], blob[5:]
        decoders: dict[bytes, Callable[[bytes], bytes]] = {
            b"Z": zlib.decompress,
            b"2": bz2.decompress,
            b"X": lzma.decompress,
            b"0": bytes,
        }
        out = decoders[method](payload)
    if len(out) != expected:
        raise ValueError(f"corrupt .rdb record: {len(out)} bytes, expected {expected}")
    return out


def read_deb_member_files(deb: Path, wanted: dict[str, str]) -> dict[str, bytes]:
    """Read files from a .deb (an ar archive holding data.tar.*) without dpkg: {key: bytes} for {key: path}."""
    data = deb.read_bytes()
    if data[:8] != b"!<arch>\n":
        raise ValueError(f"{deb} is not a Debian package (no ar header)")
    pos = 8
    while pos < len(data):
        name = data[pos : pos + 16].decode().strip().rstrip("/")
        size = int(data[pos + 48 : pos + 58].decode().strip())
        body = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                members = {m.name.lstrip("./"): m for m in tar.getmembers()}
                return {key: _tar_read(tar, members[path]) for key, path in wanted.items()}
    raise ValueError(f"{deb} has no data.tar member")


def _tar_read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:
        raise ValueError(f"{member.name} is not a regular file")
    return handle.read()


def download_deb(folder: Path) -> Path:
    """`apt-get download r-cran-janeaustenr` into folder; returns the .deb path."""
    subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=folder, check=True)
    debs = sorted(folder.glob("r-cran-janeaustenr_*.deb"))
    if not debs:
        raise SystemExit("apt-get download produced no r-cran-janeaustenr .deb (try `apt-get update` first)")
    return debs[-1]


def load_rdata(deb: Path | None, folder: Path | None) -> tuple[bytes, bytes]:
    """The (.rdx, .rdb) bytes of the package's data database, from a .deb, an installed folder, or apt-get."""
    if folder is not None:
        data_dir = folder / "data" if (folder / "data" / "Rdata.rdx").exists() else folder / DEB_DATA_DIR
        return (data_dir / "Rdata.rdx").read_bytes(), (data_dir / "Rdata.rdb").read_bytes()
    if deb is None:
        with tempfile.TemporaryDirectory() as tmp:
            return load_rdata(download_deb(Path(tmp)), None)
    files = read_deb_member_files(deb, {"rdx": f"{DEB_DATA_DIR}/Rdata.rdx", "rdb": f"{DEB_DATA_DIR}/Rdata.rdb"})
    return files["rdx"], files["rdb"]


def novel_text(obj: RObject) -> str:
    """A character vector of lines -> one text, lines joined by newlines (NA lines become empty), ending in one."""
    if obj.sexptype != STRSXP:
        raise ValueError(f"expected a character vector, got SEXP type {obj.sexptype}")
    return "\n".join(line or "" for line in obj.value).strip("\n") + "\n"


def write_gzip_text(path: Path, text: str) -> None:
    """Write text as UTF-8 gzip with no stored name or timestamp (byte-identical reruns)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        gz.write(text.encode("utf-8"))


def main(argv: list[str] | None = None) -> int:
    """Extract the six novels; print one line per file written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deb", type=Path, help="an r-cran-janeaustenr .deb (default: apt-get download it)")
    parser.add_argument("--dir", type=Path, help="an installed or extracted janeaustenr package folder")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "austen", help="output folder")
    args = parser.parse_args(argv)
    objects = lazyload_db(*load_rdata(args.deb, args.dir))
    missing = [name for name in NOVELS if name not in objects]
    if missing:
        raise SystemExit(f"the package has no {missing}; found {sorted(objects)}")
    for name in NOVELS:
        text = novel_text(objects[name])
        path = args.out / ("val" if name in VAL_NOVELS else "") / f"{name}.txt.gz"
        write_gzip_text(path, text)
        print(f"{path}: {len(objects[name].value)} lines, {len(text)} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
