"""llama.cpp's own held-out numbers for GGUF files, and llama-quantize's quantizations beside ours.

    sc = make_scorer(model_dir, eval_texts, work)          # teacher F32 GGUF (llama.cpp's converter) + its logits
    row = score(sc, "export/model.gguf", "QAD export")     # llama-perplexity --kl-divergence: KL, ppl, top-1
    files = llama_quantize_files(sc, "q4_k", work, imatrix_texts=train_texts)   # Q4_K_M, Q4_K_M + imatrix

Everything here is measured by llama.cpp's tools on llama.cpp's runtime (qatfactory/faces/llama_tools.py):
the teacher is the source model converted by llama.cpp's convert_hf_to_gguf.py to F32 (the bf16 weights
exactly), its logits over the held-out text are saved once (``--kl-divergence-base``), and every GGUF
is scored against them with ``--kl-divergence`` (mean KL(teacher || model) per token over the second half
of each ``ctx``-token chunk, llama-perplexity's rule). Used by the demo's report and by
benchmarks/llama_cpp_vs_quantize.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import gguf

from . import llama_tools as LT

# llama-quantize's way to write each GGUF family for a dense model (see recipes/format/*_gguf.yaml)
FP4_OVERRIDES = {"mxfp4": ("attn_(q|k|v|output)=mxfp4", "ffn_(gate|up|down)=mxfp4"),
                 "nvfp4": ("attn_(q|k|v|output)=nvfp4", "ffn_(gate|up|down)=nvfp4")}
KIND_OF_PRESET = {"q4_k": "q4_k", "mxfp4_gguf": "mxfp4", "nvfp4_gguf": "nvfp4"}


@dataclass
class Scorer:
    teacher_gguf: str
    base: str
    text: str
    ctx: int
    chunks: Optional[int]
    teacher_ppl: Optional[float]     # llama-perplexity's teacher perplexity (also every row's ppl_base)
    threads: int
    seconds: float


def _fingerprint(model_dir: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def write_text(texts: Sequence[str], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_text("\n\n".join(t.strip() for t in texts) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def teacher_gguf(model_dir, cache: Path) -> Path:
    """The source model as an F32 GGUF made by llama.cpp's own converter (cached by the directory's files)."""
    d = Path(cache) / "llama-teacher" / _fingerprint(Path(model_dir))
    out = d / "teacher-f32.gguf"
    if not out.is_file():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / ".tmp-teacher-f32.gguf"
        LT.convert_hf(model_dir, tmp, "f32")
        os.replace(tmp, out)
    return out


def make_scorer(model_dir, eval_texts: Sequence[str], work: Path, cache: Optional[Path] = None, ctx: int = 256,
                chunks: Optional[int] = None, threads: Optional[int] = None) -> Scorer:
    t0 = time.time()
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    th = threads or max(1, os.cpu_count() or 1)
    tg = teacher_gguf(model_dir, Path(cache) if cache else work)
    text = write_text(eval_texts, work / "heldout.txt")
    base = work / "teacher.kld"
    ppl = LT.kl_base(tg, text, base, ctx=ctx, chunks=chunks, threads=th)
    return Scorer(str(tg), str(base), str(text), ctx, chunks, ppl, th, time.time() - t0)


def gguf_summary(path) -> Dict[str, Any]:
    r = gguf.GGUFReader(str(path))
    types = Counter(t.tensor_type.name for t in r.tensors)
    data = Path(path).stat().st_size - min(int(t.data_offset) for t in r.tensors)
    emb = {t.name: t.tensor_type.name for t in r.tensors if t.name in ("token_embd.weight", "output.weight")}
    return {"bytes": Path(path).stat().st_size, "data_bytes": data, "types": dict(sorted(types.items())), **emb}


def score(sc: Scorer, gguf_path, label: str, **extra) -> Dict[str, Any]:
    t0 = time.time()
    r = LT.kl(gguf_path, sc.base, threads=sc.threads)
    if sc.teacher_ppl is None and r.ppl_base is not None:
        sc.teacher_ppl = r.ppl_base
    row = {"label": label, "path": str(gguf_path), "kl": r.kl, "ppl": r.ppl, "ppl_base": r.ppl_base, "top1": r.top1,
           "chunks": r.chunks, "tokens": r.tokens, "seconds": time.time() - t0, **gguf_summary(gguf_path), **extra}
    return row


def llama_quantize_files(sc: Scorer, kind: str, work: Path, imatrix_texts: Optional[Sequence[str]] = None,
                         imatrix_chunks: Optional[int] = None) -> Dict[str, Path]:
    """llama-quantize's own files for one family, from the teacher GGUF: {label: path}."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    out: Dict[str, Path] = {}
    if kind == "q4_k":
        p = work / "llama-quantize-Q4_K_M.gguf"
        LT.quantize(sc.teacher_gguf, p, "Q4_K_M", threads=sc.threads)
        out["llama-quantize Q4_K_M"] = p
        if imatrix_texts:
            txt = write_text(imatrix_texts, work / "imatrix-train.txt")
            im = LT.imatrix(sc.teacher_gguf, txt, work / "imatrix.gguf", ctx=sc.ctx, chunks=imatrix_chunks,
                            threads=sc.threads)
            p = work / "llama-quantize-Q4_K_M-imatrix.gguf"
            LT.quantize(sc.teacher_gguf, p, "Q4_K_M", imatrix=im, threads=sc.threads)
            out["llama-quantize Q4_K_M + imatrix"] = p
    elif kind in FP4_OVERRIDES:
        p = work / f"llama-quantize-{kind.upper()}.gguf"
        LT.quantize(sc.teacher_gguf, p, "Q8_0", tensor_types=FP4_OVERRIDES[kind], threads=sc.threads)
        out[f"llama-quantize {kind.upper()} (--tensor-type over Q8_0)"] = p
    else:
        raise ValueError(f"llama_quantize_files: kind={kind!r}; allowed: q4_k, {', '.join(FP4_OVERRIDES)}")
    return out


def _mib(b: int) -> str:
    return f"{b / 2**20:.1f}"


def _types(row) -> str:
    return ", ".join(f"{k} {v}" for k, v in row["types"].items())


def table_lines(rows: List[Dict[str, Any]], teacher_ppl: Optional[float]) -> List[str]:
    L = ["| family | model | file (MiB) | tensor data (MiB) | token_embd / output | tensor types | "
         "KL to teacher (llama.cpp) | ppl (llama.cpp) | top-1 agreement | KL (qatfactory eval) |",
         "|---|---|---:|---:|---|---|---:|---:|---:|---:|"]
    tp = "-" if teacher_ppl is None else f"{teacher_ppl:.3f}"
    L.append(f"| - | teacher F32 (llama.cpp converter) | | | | | 0 | {tp} | 1 | |")
    for r in rows:
        eo = r.get("token_embd.weight", "-") + " / " + r.get("output.weight", "(tied)")
        ours = f"{r['torch_kl']:.4f}" if r.get("torch_kl") is not None else ""
        top = f"{r['top1']:.3f}" if r.get("top1") is not None else "-"
        L.append(f"| {r.get('family', '')} | {r['label']} | {_mib(r['bytes'])} | {_mib(r['data_bytes'])} | {eo} | "
                 f"{_types(r)} | {r['kl']:.4f} | {r['ppl']:.3f} | {top} | {ours} |")
    return L


def plot(rows: List[Dict[str, Any]], png: Path, title: str) -> Path:
    import matplotlib  # noqa: PLC0415 (heavy: matplotlib; Agg is chosen at the first plot)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (heavy: matplotlib; Agg is chosen at the first plot)
    fams = list(dict.fromkeys(r.get("family", "") for r in rows))
    fig, axes = plt.subplots(1, len(fams), figsize=(4.2 * len(fams), 3.6), squeeze=False)
    for ax, fam in zip(axes[0], fams):
        rs = [r for r in rows if r.get("family", "") == fam]
        colors = ["#5e81ac" if r["label"].startswith(("QAD", "PTQ")) else "#d08770" for r in rs]
        ax.bar(range(len(rs)), [r["kl"] for r in rs], color=colors)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels([r["label"].replace("llama-quantize ", "llama-quantize\n").replace(" (", "\n(")
                            for r in rs], fontsize=7)
        for i, r in enumerate(rs):
            ax.text(i, r["kl"], f"{r['kl']:.4f}\n{_mib(r['bytes'])} MiB", ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, max(r["kl"] for r in rs) * 1.3)
        ax.set_title(f"{fam}: KL to the F32 teacher (llama-perplexity)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def report_lines(res: Optional[Dict[str, Any]], out: Path) -> List[str]:
    """The demo report's section: llama.cpp's own numbers for the GGUF exports (or why not run)."""
    L = ["## llama.cpp's own numbers for the GGUF exports\n"]
    if not res or res.get("status") != "ok":
        why = (res or {}).get("reason", "no GGUF export in this run")
        L.append(f"Not run: {why}\n")
        return L
    sc = res["scorer"]
    L.append(f"Measured by llama.cpp itself (commit 0c1e570, CPU, `--no-repack`): the teacher converted to F32 by "
             f"llama.cpp's `convert_hf_to_gguf.py`, its logits over the held-out articles saved once, every GGUF "
             f"scored with `llama-perplexity --kl-divergence` ({sc['ctx']}-token chunks, the second half of each "
             f"scored: {res['rows'][0]['chunks'] if res['rows'] else 0} chunks, "
             f"{res['rows'][0].get('tokens', 0) if res['rows'] else 0} tokens). llama.cpp's CPU matmuls quantize "
             f"activations to Q8 (Q8_K / Q8_0 by weight type), which the qatfactory evaluation (last column, "
             f"same articles, its own {res.get('torch_tokens', 0):.0f}-token windows) does not, so the two KL "
             f"columns are close, not equal.\n")
    L.extend(table_lines(res["rows"], sc["teacher_ppl"]))
    L.append("")
    if res.get("plot"):
        L.append(f"![llama_cpp_kl]({Path(res['plot']).relative_to(out)})\n")
    return L


def scorer_dict(sc: Scorer) -> Dict[str, Any]:
    return asdict(sc)


def save_json(obj: Any, path: Path) -> None:
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)
