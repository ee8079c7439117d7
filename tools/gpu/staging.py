"""The carried files of the GPU runs (benchmarks/gpu/pipeline.py, pipeline.sh pack / stash): the SmolLM2
GGUF in ``split -b`` parts with a manifest, found over several directories and reassembled with its
sha256 checked against the asset's provenance record; the stash that keeps what one device call
carried for the next; the asset cache laid out as ``qatfactory.assets.fetch`` reads it.

Standard library and ``qatfactory.assets`` (itself standard library only): ``pipeline.sh stash`` imports
this on the GPU machine before any wheel is installed. Nothing from benchmarks/gpu: the runners there import
this module, not the other way round.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from qatfactory import assets
from qatfactory.assets import sha256_file  # the asset records' own digest

PART_PREFIX = "smollm2.gguf.part-"
MANIFEST = "smollm2.gguf.parts.json"
STASH_DIR = Path("/tmp/qf-parts")
ASSET_NAMES = ("smollm2", "wiki", "gsm8k")


class PipelineError(RuntimeError):
    """A carried file is missing, incomplete or fails its checksum; the message names it and what to carry."""


def _write_atomic(path: Path, data: bytes) -> None:
    # a part cut short by a stopped call must never pass for a whole one
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def find_parts(dirs: Sequence[Path]) -> Dict[str, Path]:
    """``smollm2.gguf.part-*`` by name over the directories; the first directory holding a name wins."""
    found: Dict[str, Path] = {}
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for p in sorted(d.glob(PART_PREFIX + "*")):
            if p.is_file() and not p.name.endswith(".tmp") and p.name not in found:
                found[p.name] = p
    return found


def find_manifest(dirs: Sequence[Path]) -> Optional[dict]:
    for d in dirs:
        m = Path(d) / MANIFEST
        if m.is_file():
            return json.loads(m.read_text())
    return None


def assemble(parts: Dict[str, Path], dest: Path, want_sha: str, manifest: Optional[dict] = None) -> Dict[str, Any]:
    """Concatenate the parts in name order (split's aa, ab, ... order) into dest, atomically, and
    check the sha256 against the provenance record; a wrong or incomplete set raises PipelineError
    naming what is missing or which hash differed."""
    if manifest is not None:
        missing = [n for n in manifest["parts"] if n not in parts]
        if missing:
            raise PipelineError(f"GGUF parts missing: {missing} (found {sorted(parts)}); carry .gpu/{missing[0]} "
                                f"or stash it in {STASH_DIR}/ in an earlier call")
        for n, meta in manifest["parts"].items():
            size = parts[n].stat().st_size
            if size != meta["bytes"]:
                raise PipelineError(f"GGUF part {parts[n]} has {size} bytes, the manifest says {meta['bytes']} "
                                    f"(a truncated copy?)")
        extra = sorted(set(parts) - set(manifest["parts"]))
        if extra:
            raise PipelineError(f"GGUF parts {extra} are not in the manifest {sorted(manifest['parts'])}; "
                                f"remove stale parts from .gpu/ or {STASH_DIR}/")
    if not parts:
        raise PipelineError(f"no {PART_PREFIX}* files found")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for name in sorted(parts):
            with open(parts[name], "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
                    out.write(chunk)
    got = h.hexdigest()
    if got != want_sha:
        tmp.unlink()
        raise PipelineError(f"reassembled GGUF sha256 {got} != provenance file_sha256 {want_sha} "
                            f"(parts used: {[str(parts[n]) for n in sorted(parts)]}); a part is missing or corrupt")
    os.replace(tmp, dest)
    return {"parts": {n: str(parts[n]) for n in sorted(parts)}, "bytes": dest.stat().st_size, "sha256": got,
            "sha256_ok": True}


def split_file(src: Path, out_dir: Path, n: int = 2) -> Dict[str, Path]:
    """What ``split -b`` makes (parts aa, ab, ...) plus a manifest; pack and the smoke run use it."""
    size = src.stat().st_size
    step = -(-size // n)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts, man = {}, {"source": src.name, "bytes": size, "sha256": sha256_file(src), "parts": {}}
    with open(src, "rb") as f:
        for i in range(n):
            name = PART_PREFIX + "a" + chr(ord("a") + i)
            data = f.read(step)
            _write_atomic(out_dir / name, data)
            parts[name] = out_dir / name
            man["parts"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _write_atomic(out_dir / MANIFEST, json.dumps(man, indent=1).encode())
    return parts


def stash(src_dir: Path, stash_dir: Path) -> List[str]:
    """Copy the parts, manifest and asset files of src_dir (.gpu/) into stash_dir (/tmp/qf-parts/),
    so a later call on the same machine finds what this one carried."""
    copied = []
    if not src_dir.is_dir():
        return copied
    items = [p for p in src_dir.glob(PART_PREFIX + "*") if p.is_file()]
    if (src_dir / MANIFEST).is_file():
        items.append(src_dir / MANIFEST)
    if (src_dir / "assets").is_dir():
        items += [p for p in (src_dir / "assets").rglob("*") if p.is_file()]
    for p in items:
        dst = stash_dir / p.relative_to(src_dir)
        if dst.exists() and dst.stat().st_size == p.stat().st_size:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp")
        shutil.copyfile(p, tmp)
        os.replace(tmp, dst)
        copied.append(str(p.relative_to(src_dir)))
    return copied


def user_cache() -> Path:
    return Path(os.environ.get("QATFACTORY_CACHE", Path.home() / ".cache" / "qatfactory"))


def setup_assets(a, cache: Path) -> Dict[str, Any]:
    """Fill cache/assets/<name>/ (the layout qatfactory.assets.fetch reads, so nothing is downloaded):
    provenance records and data files from the asset dirs (.gpu/assets/<name>/, /tmp/qf-parts/assets/<name>/)
    or, as a last resort, this machine's own cache; the GGUF reassembled from its parts."""
    info: Dict[str, Any] = {}
    search = [Path(d) / "assets" for d in a.asset_dirs] + [user_cache() / "assets"]
    for name in ASSET_NAMES:
        member = Path(assets.ASSETS[name].member).name
        prov = next((d / name / "provenance.json" for d in search if (d / name / "provenance.json").is_file()), None)
        if prov is None:
            if name == "gsm8k":
                info[name] = {"status": "missing (optional)"}
                continue
            raise PipelineError(f"asset {name}: no provenance.json in {[str(d / name) for d in search]}; "
                                f"run `bash benchmarks/gpu/pipeline.sh pack` locally and carry .gpu/")
        rec = json.loads(prov.read_text())
        dst = cache / "assets" / name
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(prov, dst / "provenance.json")
        target = dst / member
        if name == "smollm2":
            info[name] = place_gguf(a, target, rec["file_sha256"])
        else:
            src = next((d / name / member for d in search if (d / name / member).is_file()), None)
            if src is None:
                if name == "gsm8k":
                    info[name] = {"status": "missing (optional)"}
                    continue
                raise PipelineError(f"asset {name}: {member} not found in {[str(d / name) for d in search]}")
            got = sha256_file(src)
            if got != rec["file_sha256"]:
                raise PipelineError(f"asset {name}: {src} sha256 {got} != provenance {rec['file_sha256']}")
            if not target.exists():
                shutil.copyfile(src, target)
            info[name] = {"file": str(src), "sha256": got, "sha256_ok": True}
        info[name]["provenance"] = {k: rec.get(k) for k in ("package", "wheel", "wheel_sha256", "file_sha256",
                                                             "license", "what")}
    info["austen"] = setup_austen(search, cache)
    return info


def setup_austen(search: Sequence[Path], cache: Path) -> Dict[str, Any]:
    """The Austen novels (a Debian asset, used by the paper reproductions and their GPU tests):
    austen.json + provenance.json from the first search dir holding both, sha256 checked, into
    cache/assets/austen/. Optional: {"status": "missing (optional)"} when no dir has them."""
    src = next((Path(d) / "austen" for d in search
                if (Path(d) / "austen" / assets.AUSTEN_FILE).is_file()
                and (Path(d) / "austen" / "provenance.json").is_file()), None)
    if src is None:
        return {"status": "missing (optional)", "searched": [str(Path(d) / "austen") for d in search]}
    rec = json.loads((src / "provenance.json").read_text())
    got = sha256_file(src / assets.AUSTEN_FILE)
    if got != rec.get("file_sha256"):
        raise PipelineError(f"asset austen: {src / assets.AUSTEN_FILE} sha256 {got} != provenance "
                            f"{rec.get('file_sha256')}")
    dst = cache / "assets" / "austen"
    dst.mkdir(parents=True, exist_ok=True)
    for n in (assets.AUSTEN_FILE, "provenance.json"):
        if (src / n).resolve() != (dst / n).resolve():
            shutil.copyfile(src / n, dst / n)
    return {"file": str(src / assets.AUSTEN_FILE), "sha256": got, "sha256_ok": True}


def place_gguf(a, target: Path, want_sha: str) -> Dict[str, Any]:
    if target.exists() and sha256_file(target) == want_sha:
        return {"reused": str(target), "sha256": want_sha, "sha256_ok": True, "bytes": target.stat().st_size}
    dirs = [Path(d) for d in a.asset_dirs]
    parts = find_parts(dirs)
    if not parts and a.smoke:
        # the smoke run exercises the reassembly with this machine's cached GGUF cut in two
        src = user_cache() / "assets" / "smollm2" / target.name
        if not src.is_file():
            raise PipelineError(f"smoke: no GGUF parts and no cached {src}")
        pdir = Path(a.work) / "parts"
        split_file(src, pdir)
        dirs.append(pdir)
        parts = find_parts(dirs)
    r = assemble(parts, target, want_sha, find_manifest(dirs))
    r["dirs_searched"] = [str(d) for d in dirs]
    return r
