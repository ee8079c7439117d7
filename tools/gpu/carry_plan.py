"""Which staged files each device call carries (tools/gpu/stage.sh `plan`, `pack-sglang`).

A device call carries the working tree plus at most 8 named paths, 64 MiB in all. The vLLM stack and
SmolLM2 already need six calls whose groups leave room; SGLang's bundle (one tar of wheels) is cut into
parts that fill that room in call order, and whatever does not fit goes in extra stash calls placed
just before the vLLM call: that call installs SGLang and starts its JIT warm-up in the background, so every
part must be on the machine by then. The carried JIT caches (.sglang/jit, stage.sh stage-jit) ride in
the first call up to the vLLM call with room for them, else in one more stash call before it. Part sizes
are fixed at pack time from the sizes staged then; `plan` re-checks every call against the cap with the
tree as it is now.

    python tools/gpu/carry_plan.py plan  [--tree BYTES]
    python tools/gpu/carry_plan.py split BUNDLE --out .sglang [--tree BYTES] [--margin-kib 512]
    python tools/gpu/carry_plan.py assemble --parts /tmp/qf-parts --dest /tmp/sgwheels   # GPU machine
    python tools/gpu/carry_plan.py ready --parts /tmp/qf-parts      # exit 0 iff every part is there
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

MIB = 2 ** 20
CAP = 64 * MIB                 # a call's working tree + carried paths
MAX_PATHS = 8                  # paths one call may name in carry
MARGIN = 512 * 1024            # room left in each call for the tree to grow after packing
SGLANG_DIR = ".sglang"
MANIFEST = "sglang.manifest.json"
PART_PREFIX = "sglang.tar.part-"

# (carried paths or globs, the command of that call): the calls engines.sh documents, in order
BASE_CALLS = [
    ([".whl", ".vllm/deps", ".vllm/vllm.manifest", ".gpu/assets", ".gpu/smollm2.gguf.parts.json"],
     "bash benchmarks/gpu/engines.sh preflight"),
    ([".gpu/smollm2.gguf.part-aa"], "bash benchmarks/gpu/engines.sh stash"),
    # stage.sh cuts vLLM's zip in 56 MiB parts (since 2026-12-06; the tree grew past what 58 MiB parts leave
    # room for): the fourth, ~9 MiB, rides here, before the vLLM call that reassembles all four from the manifest
    ([".gpu/smollm2.gguf.part-ab", ".vllm/vllm.zip.part-ad"], "bash benchmarks/gpu/engines.sh students"),
    ([".vllm/vllm.zip.part-aa"], "bash benchmarks/gpu/engines.sh stash"),
    ([".vllm/vllm.zip.part-ab"], "bash benchmarks/gpu/engines.sh stash"),
    ([".vllm/vllm.zip.part-ac"], "bash benchmarks/gpu/engines.sh vllm"),
]
SGLANG_CALL = "bash benchmarks/gpu/engines.sh sglang"
STASH_CALL = "bash benchmarks/gpu/engines.sh stash"
WARM_CALL = len(BASE_CALLS)    # the vLLM call: SGLang's install and JIT warm-up start there
JIT_DIR = f"{SGLANG_DIR}/jit"  # carried JIT caches (sglang_jit.py)


def size(root: Path, rel: str) -> int:
    p = root / rel
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size if p.exists() else 0


def tree_bytes(root: Path) -> int:
    """Bytes of what travels besides the carried paths: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    files = {f for f in out.decode().split("\0") if f}
    return sum((root / f).lstat().st_size for f in files if (root / f).is_file() or (root / f).is_symlink())


def rooms(root: Path, tree: int, margin: int = MARGIN, calls=BASE_CALLS) -> List[int]:
    """Free bytes in each base call under the cap, `margin` kept back (SGLang's few-KiB manifest, which
    rides in the first call, and the tree's growth after packing fit in it)."""
    out = []
    for paths, _ in calls:
        used = tree + sum(size(root, p) for p in paths)
        out.append(max(0, CAP - margin - used))
    return out


def cut(total: int, room: Sequence[int], part_max: int = 60 * MIB, min_part: int = 64 * 1024) -> List[Dict[str, int]]:
    """Split `total` bytes: first into the rooms (call order, pieces under `min_part` skipped), the rest
    into parts of at most `part_max`, one slot each past the rooms. Returns [{"size", "ride"}] where ride
    is the 1-based slot: 1..len(room) the base calls, beyond them the extra calls (`final_calls` says where
    those go in the sequence)."""
    parts, left = [], total
    for i, r in enumerate(room):
        take = min(r, left)
        if take >= min_part or (take == left and take > 0):
            parts.append({"size": take, "ride": i + 1})
            left -= take
        if left == 0:
            break
    call = len(room) + 1
    while left > 0:
        take = min(part_max, left)
        parts.append({"size": take, "ride": call})
        left -= take
        call += 1
    return parts


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def final_calls(parts: List[Dict[str, int]], n_base: int = len(BASE_CALLS)) -> List[Dict[str, int]]:
    """Slots (cut) -> call numbers: the extra slots become stash calls just before the last base call (the
    vLLM call, which installs SGLang and starts its warm-up), which moves that call back by as many."""
    extra = max([p["ride"] - n_base for p in parts] + [0])
    out = []
    for p in parts:
        r = p["ride"]
        r = r if r < n_base else (n_base + extra if r == n_base else n_base + r - n_base - 1)
        out.append(dict(p, ride=r))
    return out


def split(bundle: Path, out: Path, parts: List[Dict[str, int]]) -> List[Dict[str, object]]:
    """Write the parts of `bundle` into `out` (atomically, each a fresh file) and return their records."""
    recs, off = [], 0
    with open(bundle, "rb") as src:
        for i, p in enumerate(parts):
            name = f"{PART_PREFIX}{i:02d}"
            tmp = out / f".{name}.tmp"
            with open(tmp, "wb") as dst:
                left = p["size"]
                while left:
                    b = src.read(min(left, 1 << 20))
                    if not b:
                        raise ValueError(f"{bundle} ended early at part {name}")
                    dst.write(b)
                    left -= len(b)
            os.replace(tmp, out / name)
            recs.append({"name": name, "size": p["size"], "ride": p["ride"], "offset": off,
                         "sha256": sha256(out / name)})
            off += p["size"]
        if src.read(1):
            raise ValueError(f"{bundle} is longer than its parts")
    return recs


def assemble(parts_dir: Path, man: Dict[str, object], dest: Path) -> List[Path]:
    """Rebuild the bundle from its parts in `parts_dir` (each part's and the whole's sha256 checked) and
    unpack its wheels into `dest`, each checked against the manifest; returns the wheel paths.
    Nothing is trusted from inside the bundle: member names must be the manifest's plain file names."""
    import tarfile
    missing = [p["name"] for p in man["parts"] if not (parts_dir / p["name"]).is_file()]
    if missing:
        raise FileNotFoundError(f"SGLang parts not on this machine yet: {missing} (in {parts_dir})")
    for p in man["parts"]:
        got = sha256(parts_dir / p["name"])
        if got != p["sha256"]:
            raise ValueError(f"{p['name']}: sha256 {got} != manifest {p['sha256']}")
    dest.mkdir(parents=True, exist_ok=True)
    bundle = dest / ".bundle.tar"
    with open(bundle, "wb") as out:
        for p in man["parts"]:
            out.write((parts_dir / p["name"]).read_bytes())
    want = man["bundle"]["sha256"]
    if sha256(bundle) != want:
        raise ValueError(f"reassembled bundle sha256 != manifest {want}")
    wheels = {w["file"]: w["sha256"] for w in man["wheels"]}
    paths = []
    with tarfile.open(bundle) as tf:
        members = tf.getmembers()
        for m in members:          # all checked before anything is written
            if not m.isfile() or m.name not in wheels or "/" in m.name or m.name.startswith("."):
                bundle.unlink()
                raise ValueError(f"unexpected member {m.name!r} in the SGLang bundle")
        for m in members:
            target = dest / m.name
            with tf.extractfile(m) as src, open(target, "wb") as dst:
                dst.write(src.read())
            if sha256(target) != wheels[m.name]:
                raise ValueError(f"{m.name}: sha256 differs from the manifest")
            paths.append(target)
    bundle.unlink()
    if sorted(p.name for p in paths) != sorted(wheels):
        raise ValueError("the SGLang bundle lacks wheels its manifest lists")
    return paths


def write_manifest(out: Path, bundle: Path, wheels_dir: Path, parts, version: str,
                   shared: List[str], slim: List[str], keep: Optional[Dict[str, List[str]]] = None) -> Dict[str, object]:
    """The manifest `install-sglang` checks against: each wheel (sha256; a slimmed one also its PyPI
    sha256, the patterns removed and what of them was kept), the bundle and its parts (`parts`: split's
    {"parts", "extra_calls"}, or a bare list of parts riding in the base calls)."""
    if isinstance(parts, dict):
        extra, parts = int(parts.get("extra_calls", 0)), parts["parts"]
    else:
        extra = 0
    keep = keep or {}
    wheels = []
    for w in sorted(wheels_dir.glob("*.whl")):
        rec: Dict[str, object] = {"file": w.name, "sha256": sha256(w), "bytes": w.stat().st_size}
        orig = w.with_name(w.name + ".orig-sha256")
        if orig.exists():
            rec["pypi_sha256"] = orig.read_text().strip()
            rec["removed"] = next(x.split(":", 1)[1].split() for x in slim if w.name.startswith(x.split(":", 1)[0]))
            kept = next((v for k, v in keep.items() if w.name.startswith(k)), None)
            if kept:
                rec["kept_for_flashinfer_jit"] = kept
        wheels.append(rec)
    man = {"sglang": version, "wheels": wheels, "shared_from_vllm_deps": list(shared),
           "bundle": {"name": bundle.name, "bytes": bundle.stat().st_size, "sha256": sha256(bundle)},
           "parts": parts, "extra_calls": extra}
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(man, indent=1))
    os.replace(tmp, out)
    return man


def load_manifest(root: Path) -> Optional[Dict[str, object]]:
    p = root / SGLANG_DIR / MANIFEST
    return json.loads(p.read_text()) if p.exists() else None


def calls(root: Path, tree: int) -> List[Dict[str, object]]:
    """Every call: its carry list, bytes (tree included) and command, SGLang's parts and JIT caches folded in."""
    man = load_manifest(root)
    out = [{"carry": list(paths), "cmd": cmd} for paths, cmd in BASE_CALLS]
    if man:
        extra = int(man.get("extra_calls", 0))
        out = out[:WARM_CALL - 1] + [{"carry": [], "cmd": STASH_CALL} for _ in range(extra)] + out[WARM_CALL - 1:]
        out[0]["carry"].append(f"{SGLANG_DIR}/{MANIFEST}")
        for p in man["parts"]:
            if not 1 <= p["ride"] <= len(out):
                raise ValueError(f"{p['name']} rides in call {p['ride']}, past the vLLM call: a manifest of an "
                                 "older carry plan; run stage.sh pack-sglang again")
            out[p["ride"] - 1]["carry"].append(f"{SGLANG_DIR}/{p['name']}")
        out.append({"carry": [], "cmd": SGLANG_CALL})
        jit = size(root, JIT_DIR)
        if jit:       # before the warm-up (the vLLM call): the first call with room, else one more stash call
            warm = WARM_CALL + extra
            for c in out[:warm]:
                used = tree + sum(size(root, q) for q in c["carry"])
                if used + jit <= CAP - MARGIN and len(c["carry"]) < MAX_PATHS:
                    c["carry"].append(JIT_DIR)
                    break
            else:
                out.insert(warm - 1, {"carry": [JIT_DIR], "cmd": STASH_CALL})
    for c in out:
        c["bytes"] = tree + sum(size(root, p) for p in c["carry"])
        c["ok"] = c["bytes"] < CAP and len(c["carry"]) <= MAX_PATHS
    return out


def sglang_complete_by(root: Path, tree: int = 0) -> Optional[int]:
    """The call after which every SGLang part and carried JIT cache is on the machine (None: nothing packed)."""
    if not load_manifest(root):
        return None
    have = [i for i, c in enumerate(calls(root, tree), 1)
            if any(p.startswith(f"{SGLANG_DIR}/{PART_PREFIX}") or p == JIT_DIR for p in c["carry"])]
    return max(have) if have else None


def warm_call(root: Path, tree: int = 0) -> int:
    """The number of the vLLM call, which starts SGLang's install and JIT warm-up."""
    return next(i for i, c in enumerate(calls(root, tree), 1) if c["cmd"] == BASE_CALLS[-1][1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["plan", "split", "assemble", "manifest", "ready"])
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[2]))
    ap.add_argument("--out", default=SGLANG_DIR)
    ap.add_argument("--tree", type=int, default=None, help="bytes of the working tree (default: git ls-files)")
    ap.add_argument("--parts", help="assemble: the folder holding the parts and the manifest")
    ap.add_argument("--dest", help="assemble: where the wheels go")
    ap.add_argument("--bundle"), ap.add_argument("--wheels"), ap.add_argument("--parts-json", dest="parts_json")
    ap.add_argument("--version"), ap.add_argument("--shared", default="")
    ap.add_argument("--slim", nargs="*", default=[])
    ap.add_argument("--keep", nargs="*", default=[], help="wheel-prefix:module,... (FlashInfer JIT modules kept)")
    ap.add_argument("--margin-kib", type=int, default=MARGIN // 1024, dest="margin_kib")
    a = ap.parse_args(argv)
    root = Path(a.root)
    if a.cmd == "ready":        # exit 0 iff the manifest and every part (by size) are in --parts
        mp = Path(a.parts) / MANIFEST
        if not mp.exists():
            print(f"no {mp}")
            return 1
        man = json.loads(mp.read_text())
        missing = [p["name"] for p in man["parts"]
                   if not (Path(a.parts) / p["name"]).is_file() or (Path(a.parts) / p["name"]).stat().st_size != p["size"]]
        print("ready" if not missing else f"missing {missing}")
        return 1 if missing else 0
    if a.cmd == "assemble":
        man = json.loads((Path(a.parts) / MANIFEST).read_text())
        try:
            for w in assemble(Path(a.parts), man, Path(a.dest)):
                print(w)
        except (FileNotFoundError, ValueError) as e:
            print(f"assemble: {e}", file=sys.stderr)
            return 2
        return 0
    if a.cmd == "manifest":
        keep = {k.split(":", 1)[0]: k.split(":", 1)[1].split(",") for k in a.keep}
        man = write_manifest(root / SGLANG_DIR / MANIFEST, Path(a.bundle), Path(a.wheels),
                             json.loads(Path(a.parts_json).read_text()), a.version, a.shared.split(), a.slim, keep)
        for w in man["wheels"]:
            print(f"{w['bytes'] / MIB:6.2f} MiB {w['file']}" + (f"  (slimmed: {' '.join(w['removed'])})"
                                                              if "removed" in w else "")
                  + (f" (kept for FlashInfer JIT: {','.join(w['kept_for_flashinfer_jit'])})"
                     if "kept_for_flashinfer_jit" in w else ""))
        print(f"bundle {man['bundle']['bytes'] / MIB:.1f} MiB in {len(man['parts'])} parts: " +
              ", ".join(f"{p['name']} {p['size'] / MIB:.1f} MiB -> call {p['ride']}" for p in man["parts"]))
        return 0
    tree = tree_bytes(root) if a.tree is None else a.tree
    if a.cmd == "split":
        if not a.bundle:
            ap.error("split needs the bundle")
        bundle = Path(a.bundle)
        parts = cut(bundle.stat().st_size, rooms(root, tree, a.margin_kib * 1024))
        extra = max([p["ride"] - len(BASE_CALLS) for p in parts] + [0])
        recs = split(bundle, root / a.out, final_calls(parts))
        json.dump({"parts": recs, "extra_calls": extra}, sys.stdout, indent=1)
        print()
        return 0
    bad = 0
    for i, c in enumerate(calls(root, tree), 1):
        bad += not c["ok"]
        print(f"call {i}: {c['bytes'] / MIB:5.1f} MiB {'OK ' if c['ok'] else 'TOO BIG'} carry={c['carry']}  "
              f"-> {c['cmd']}")
    done = sglang_complete_by(root, tree)
    if done:
        warm = warm_call(root, tree)
        print(f"SGLang parts{' and JIT caches' if size(root, JIT_DIR) else ''} all on the machine after call {done}"
              + (f" (call {warm}, the vLLM call, then installs it and compiles its JIT kernels in the background)"
                 if done <= warm else f" -- AFTER the vLLM call {warm} that starts its warm-up"))
        bad += done > warm
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
