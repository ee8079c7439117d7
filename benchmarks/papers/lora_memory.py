"""Run-set B3 (QATFactory, arXiv 2609.39223; shared/reference/reproductions.md 4.B3): LoRA-QAD against full QAD.
The paper: LoRA-QAD (merge W + BA, then quantize) uses 2.9x less memory (rank 16, a 9B model at 8K) but keeps
a quality gap that more rank does not close (KL 0.0682 full, 0.0735 r16, 0.0777 r256).

    python benchmarks/papers/lora_memory.py --out benchmarks/results             # GPU preset (SmolLM2-135M)
    python benchmarks/papers/lora_memory.py --smoke --out /tmp/papers           # CPU, tiny random model

Quality: full QAD, LoRA-QAD r16 and r256 (alpha = rank, all seven projections, base frozen), NVFP4 W4A16,
same steps and tokens, LoRA LR 10x the full LR; held-out KL / top-1 / PPL.

Memory, per arm, in two configurations (i) parameter-dominated: 1 x 2,048 tokens with activation
checkpointing and (ii) throughput: 4 x 2,048 without: one training step built like the trainer's
(qatfactory.train (student.py: StudentLM, the chunked KL loss, a live teacher that is a deep copy of the
model, bf16 weights with fp32 master copies, fp32 gradient buffers and AdamW moments as DeepSpeed's bf16
optimizer keeps them), phase by phase:

* weights: allocator growth while the student (quantizers, LoRA) and the teacher copy are built;
* masters / optimizer / grads: the bytes of the fp32 masters, of AdamW's moments and of the gradients
  (the bf16 ones on the trainable parameters and the fp32 buffers), counted tensor by tensor;
* activations: allocator growth over the forward (what autograd keeps for the backward, plus the teacher's
  hidden states); the bytes autograd saved are also counted through saved-tensor hooks, on any device;
* logits: the forward's peak above its end (the chunked loss's transient logits and softmax);
* not a part: the GEMM library's workspaces. A small matmul forward and backward in both dtypes runs before the
  baseline, so the workspaces it makes (kept by the allocator for the process: 64.1 MiB in the first probe of an
  H100 run of 2026-12-06, 0.1 MiB in the probes after it) sit below the baseline; the bytes it made are recorded
  as ``gemm_workspace_before_base``;
* measured peak: torch.cuda.max_memory_allocated over the step; ``other`` = measured peak - the sum of
  the parts (the parts do not all live at the same moment, so ``other`` can be negative);
* the trainer's own peak (torch.cuda.max_memory_allocated over a 2-step run of ``loop.run`` with the same
  settings) beside it. On a CPU nothing is measured by an allocator: only the counted parts are reported.

Writes ``lora_memory.md`` / ``.json`` / ``.png`` into --out.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import papers_common as C  # noqa: E402

TAG = "lora_memory"
FORMAT = "nvfp4_w4a16"
ARMS = [{"name": "full_qad", "rank": 0, "kind": "train"}, {"name": "lora_r16", "rank": 16, "kind": "train"},
        {"name": "lora_r256", "rank": 256, "kind": "train"}]
PARTS = ("weights", "masters", "optimizer", "grads", "activations", "logits")


def preset(smoke: bool) -> Dict[str, Any]:
    if smoke:
        return dict(steps=3, micro=2, seq=32, lr=1e-3, lora_lr_factor=10.0, eval_seq=64, eval_windows=2, warmup=0,
                    mem=[{"name": "i", "micro": 1, "seq": 64, "ckpt": True}, {"name": "ii", "micro": 2, "seq": 64,
                                                                               "ckpt": False}],
                    limits={"wiki_train": 30_000, "austen_train": 20_000, "wiki_ho": 3_000})
    # 80 x 8 x 512 tokens per arm: the 10-minute budget of benchmarks/gpu/papers.sh
    return dict(steps=80, micro=8, seq=512, lr=5e-5, lora_lr_factor=10.0, eval_seq=1024, eval_windows=12, warmup=5,
                mem=[{"name": "i", "micro": 1, "seq": 2048, "ckpt": True},
                     {"name": "ii", "micro": 4, "seq": 2048, "ckpt": False}],
                limits={"wiki_train": 800_000, "austen_train": 800_000})


def arm_overrides(a, p, data, arm, seed, run_dir, micro=None, seq=None, ckpt=False, steps=None) -> List[str]:
    f = data["files"]
    r = arm["rank"]
    lr = p["lr"] * (p["lora_lr_factor"] if r else 1.0)
    o = C.model_overrides(a.smoke, a.model_path, a.device) + [f"format={FORMAT}"]
    o += ["method=qad_lora", f"quant.lora.rank={r}", f"quant.lora.alpha={float(r)}"] if r else ["method=qad"]
    o += ["data=files", f"data.train=[{f['wiki_train']},{f['austen_train']}]", f"data.eval=[{f['wiki_ho']}]",
          f"data.seq_len={seq or p['seq']}", "data.eval_samples=2"]
    o += C.train_overrides(a.device, run_dir, seed, steps or p["steps"], lr, micro or p["micro"], 1, 0, a.smoke,
                           p["warmup"])
    if ckpt:
        o.append("train.grad_ckpt=true")
    return o


# ----------------------------------------------------------------------------- memory
def _bytes(ts) -> int:
    seen, n = set(), 0
    for t in ts:
        if t is None:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key in seen:
            continue
        seen.add(key)
        n += s.nbytes()
    return n


def _warm_gemm(dev) -> int:
    """A 64 x 64 matmul's forward and backward in float32 and bfloat16, before the baseline: the GEMM library's
    workspaces (one per handle and stream; autograd's backward runs on its own thread, with its own handle) are
    made here and kept by the allocator, so they are not in the step's parts or its peak. Returns the bytes this
    left allocated (0 once a process has them). History (H100, 2026-12-06): measured as a transient peak and
    added as a seventh part, it was 64.1 MiB in a process's first probe and 0.1 MiB after (a workspace made once
    and kept, already below the baseline: counting it twice made 'other' 64 MiB too low). The smoke's 31.7 MiB
    of 'other' stayed with the workspaces made first, so it is something else: benchmarks/gpu/mem_trace.py lists
    the probe's large allocations with their Python frames, not yet run."""
    import torch
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    x = torch.ones(64, 64, device=dev, requires_grad=True)
    for dt in (torch.float32, torch.bfloat16):
        y = x.to(dt)
        (y @ y).float().sum().backward()
    del x, y
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - m0


def probe(a, p, data, arm, mem) -> Dict[str, Any]:
    """One instrumented training step (module docstring): the parts and, on a GPU, the measured peak."""
    import torch

    from qatfactory.distill.teachers import LiveTeacher
    from qatfactory.quantize import calibrate, prepare
    from qatfactory.train.config import compose
    from qatfactory.train.runtime import build_model
    from qatfactory.train.student import StudentLM
    cfg = compose(arm_overrides(a, p, data, arm, 0, Path("/nonexistent"), mem["micro"], mem["seq"], mem["ckpt"]))
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    bf16 = cfg.train.precision == "bf16"

    def alloc():
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return None

    workspace = None
    if cuda:
        torch.cuda.empty_cache()
        workspace = _warm_gemm(dev)
        torch.cuda.reset_peak_memory_stats()
    base = alloc()
    model, _, _ = build_model(cfg, dev)
    model.to(dev)
    tmodel = copy.deepcopy(model)
    prepare(model, cfg.quant)
    calibrate(model, None, cfg.quant.calib_method)
    if cfg.train.grad_ckpt:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if bf16:
        model.to(torch.bfloat16)                  # DeepSpeed's bf16 mode casts the module, LoRA included
    teacher = LiveTeacher(tmodel, torch.bfloat16 if bf16 else torch.float32, dev)
    student = StudentLM(model, cfg.method.loss)
    student.train()
    trainable = [q for q in student.parameters() if q.requires_grad]
    r: Dict[str, Any] = {"arm": arm["name"], "config": mem["name"], "micro": mem["micro"], "seq": mem["seq"],
                         "grad_ckpt": mem["ckpt"], "trainable_params": sum(q.numel() for q in trainable),
                         "params": sum(q.numel() for q in student.parameters()) + sum(q.numel() for q in tmodel.parameters())}
    after_w = alloc()
    counted_w = _bytes(list(student.parameters()) + list(student.buffers()) + list(tmodel.parameters()) +
                       list(tmodel.buffers()))
    masters = [q.detach().float().clone() for q in trainable] if bf16 else trainable
    opt = torch.optim.AdamW(masters, lr=1e-12, betas=(0.9, 0.999), weight_decay=0.0)
    for q in masters:
        q.grad = torch.zeros_like(q, dtype=torch.float32)
    opt.step()                                    # creates the moments; zero gradients leave the weights as they are
    after_opt = alloc()
    parts_counted = {"weights": counted_w, "masters": _bytes(masters) if bf16 else 0,
                     "optimizer": _bytes([v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)])}
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (mem["micro"], mem["seq"]), generator=g).to(dev)
    attn = torch.ones_like(ids)
    mask = torch.ones_like(ids, dtype=torch.bool)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    a0 = alloc()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with teacher.outputs(ids, attn) as tout:
            loss = student(ids, attn, mask, tout)
            a1 = alloc()
            peak_fwd = torch.cuda.max_memory_allocated() if cuda else None
            saved_bytes = _bytes(saved)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            loss.backward()
    saved.clear()
    peak_bwd = torch.cuda.max_memory_allocated() if cuda else None
    grads_b = _bytes([q.grad for q in trainable]) + (_bytes([q.grad for q in masters]) if bf16 else 0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if bf16:
        for q, m in zip(trainable, masters):
            if q.grad is not None:
                m.grad.copy_(q.grad)
    opt.step()
    peak_step = torch.cuda.max_memory_allocated() if cuda else None
    parts_counted["grads"] = grads_b
    parts_counted["activations_saved"] = saved_bytes
    r["counted"] = parts_counted
    if cuda:
        parts = {"weights": after_w - base, "masters": parts_counted["masters"],
                 "optimizer": parts_counted["optimizer"], "grads": grads_b, "activations": a1 - a0,
                 "logits": peak_fwd - a1}
        peak = max(peak_fwd, peak_bwd, peak_step) - base
        r.update(parts=parts, measured_peak=peak, other=peak - sum(parts.values()),
                 gemm_workspace_before_base=workspace,
                 phases={"after_weights": after_w - base, "after_optimizer_state": after_opt - base,
                         "forward_end": a1 - base, "forward_peak": peak_fwd - base, "backward_peak": peak_bwd - base,
                         "step_peak": peak_step - base})
    del opt, masters, student, teacher, tmodel, model, loss
    C.free()
    return r


def trainer_peak(a, p, data, arm, mem, work) -> Optional[float]:
    """torch.cuda.max_memory_allocated over a 2-step run of the trainer itself with the probe's settings."""
    import torch
    if a.device != "cuda":
        return None
    C.free()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = arm_overrides(a, p, data, arm, 0, work / f"mem-{arm['name']}-{mem['name']}", mem["micro"], mem["seq"],
                      mem["ckpt"], steps=2) + ["train.save_student=false", "data.eval_samples=1"]
    C.run_arm(o)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# ----------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.base_args(ap)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-quality", action="store_true")
    a = ap.parse_args(argv)
    a.device = C.resolve_device(a)
    p = preset(a.smoke)
    p.update({k: v for k, v in (("steps", a.steps), ("lr", a.lr)) if v})
    work = a.work or a.out / f"work-{TAG}"
    budget = C.Budget(a.budget_s)
    runs = C.runs_dir(work)
    data = C.data_files(work, ("wiki_train", "austen_train", "wiki_ho"), p["limits"])
    seeds = list(range(a.seeds))
    res: Dict[str, Any] = {"smoke": a.smoke, "preset": p, "format": FORMAT, "memory": [], "arms": [],
                           "provenance": C.provenance(C.model_record(a.smoke, a.model_path), data, seeds, a.device)}
    prior = C.load_prior(a.prior, res)
    kept_mem = {(r["arm"], r["config"]): r for r in C.kept_rows(prior, "memory")}

    def save(_=None):
        res["verdicts"] = verdicts(res)
        report(a.out, res)

    if not a.no_memory:
        for mem in p["mem"]:
            for arm in ARMS:
                if (arm["name"], mem["name"]) in kept_mem:
                    C.say(TAG, f"memory {arm['name']} config {mem['name']}: kept from the prior run")
                    res["memory"].append(kept_mem[(arm["name"], mem["name"])])
                    continue
                if not budget.fits(30.0 if not a.smoke else 1.0):
                    res["memory"].append({"arm": arm["name"], "config": mem["name"], "status": "not run (time budget)"})
                    continue
                C.say(TAG, f"memory {arm['name']} config {mem['name']}")
                try:
                    r = probe(a, p, data, arm, mem)
                    r["trainer_peak"] = trainer_peak(a, p, data, arm, mem, runs)
                    r["status"] = "done"
                except Exception as e:  # noqa: BLE001 - reported in the table; the rest still runs
                    import traceback
                    traceback.print_exc()
                    r = {"arm": arm["name"], "config": mem["name"], "seed": 0,
                         "status": f"failed: {type(e).__name__}: {e}"[:300]}
                res["memory"].append(r)
                save()
    import torch
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    if not a.no_quality:
        teacher, tok, _ = C.load_teacher(a.smoke, a.model_path, a.device)
        ev = C.Evaluator(teacher, tok, {"wiki_ho": data["files"]["wiki_ho"]}, {"*": p["eval_seq"]}, p["eval_windows"],
                         a.device)
        res["teacher"] = ev.evaluate(teacher)

        def one(arm, seed):
            run_dir = runs / f"{arm['name']}-s{seed}"
            C.run_arm(arm_overrides(a, p, data, arm, seed, run_dir))
            return {"eval": C.student_eval(run_dir, ev, dtype, a.device), "step_ms": C.step_ms(run_dir)}

        def saved(results):
            res["arms"] = results
            save()

        C.run_schedule(ARMS, seeds, budget, one, saved, TAG, keep=C.kept_rows(prior, "arms"))
    save()
    print((a.out / f"{TAG}.md").read_text())
    return 1 if C.failures(res.get("arms", []) + res["memory"]) else 0


def _mem(res, arm, cfg) -> Optional[Dict[str, Any]]:
    return next((m for m in res["memory"] if m.get("arm") == arm and m.get("config") == cfg and
                 m.get("status") == "done"), None)


def verdicts(res) -> List[Dict[str, Any]]:
    R, out = res.get("arms", []), []
    for cfg in [m["name"] for m in res["preset"]["mem"]]:
        f, l16 = _mem(res, "full_qad", cfg), _mem(res, "lora_r16", cfg)
        if f and l16 and f.get("measured_peak") is not None:
            # two measurements of each peak: the instrumented step and the trainer's own run
            fv = [f["measured_peak"] / 2**30] + ([f["trainer_peak"] / 2**30] if f.get("trainer_peak") else [])
            lv = [l16["measured_peak"] / 2**30] + ([l16["trainer_peak"] / 2**30] if l16.get("trainer_peak") else [])
            v = C.verdict(f"LoRA-QAD r16 needs less memory than full QAD (config {cfg})", "peak GiB", "lora_r16", lv,
                          "full_qad", fv, +1)
            v["ratio_full_over_lora"] = C.mean_or_nan(fv) / C.mean_or_nan(lv)
            v["why"] += f"; full / LoRA = {v['ratio_full_over_lora']:.2f}x (paper: 2.9x at 9B, 8K)"
            out.append(v)
    kl = {n: C.values(R, n, lambda r: r["eval"]["wiki_ho"]["kl"]) for n in ("full_qad", "lora_r16", "lora_r256")}
    out.append(C.verdict("LoRA-QAD r16 keeps a gap to full QAD", "WIKI-HO KL", "full_qad", kl["full_qad"], "lora_r16",
                         kl["lora_r16"], +1))
    out.append(C.verdict("rank 256 does not close the gap", "WIKI-HO KL", "full_qad", kl["full_qad"], "lora_r256",
                         kl["lora_r256"], +1))
    return out


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _other(m: Dict[str, Any]) -> Optional[int]:
    """measured peak - the six parts. Computed here, not read: rows of the H100 run of 2026-12-06 11:04 UTC stored
    an 'other' that also subtracted a seventh part, the GEMM workspace, which lies below the baseline."""
    parts = m.get("parts")
    if m.get("measured_peak") is None or not parts:
        return m.get("other")
    return m["measured_peak"] - sum(parts[k] for k in PARTS)


def report(out: Path, res: Dict[str, Any]) -> None:
    p, R = res["preset"], res.get("arms", [])
    lines = C.header("LoRA-QAD vs full QAD: memory and quality (QATFactory)", res)
    mrows = []
    for m in res["memory"]:
        if m.get("status") != "done":
            mrows.append([m["arm"], m["config"], m["status"]] + ["-"] * (len(PARTS) + 5))
            continue
        parts = m.get("parts") or {}
        c = m["counted"]
        mrows.append([m["arm"], m["config"] + (" (prior)" if m.get("prior") else ""),
                      f"{m['micro']} x {m['seq']}{' ckpt' if m['grad_ckpt'] else ''}",
                      f"{m['trainable_params']:,}"]
                     + [_mib(parts.get(k, c.get(k))) for k in PARTS]
                     + [_mib(c.get("activations_saved")), _mib(m.get("measured_peak")), _mib(_other(m)),
                        _mib(m.get("trainer_peak"))])
    lines += ["## Peak memory, MiB", "",
              "weights / activations / logits: allocator deltas (GPU); masters / optimizer / grads: counted bytes; "
              "'saved' = bytes autograd kept, counted with saved-tensor hooks; 'other' = measured peak - sum of the "
              "six parts (they do not all coexist). The GEMM library's workspaces are made before the baseline and "
              "are in neither. On a CPU only the counted columns are filled.", "",
              C.md_table(["arm", "config", "micro x seq", "trainable"] + list(PARTS) +
                         ["saved", "measured peak", "other", "trainer peak"], mrows), ""]
    kept = sorted({(m["prior"].get("date"), m["prior"].get("device")) for m in res["memory"] if m.get("prior")})
    lines += [f"(prior) = kept from an earlier run: {', '.join(f'{d}, {g}' for d, g in kept)}.", ""] if kept else []
    rows = []
    for arm in ARMS:
        n = arm["name"]
        v = C.values(R, n, lambda r: r["eval"]["wiki_ho"]["kl"])
        if not v:
            rows.append([n, arm["rank"] or "-", "not run", "-", "-", "-", "-"])
            continue

        def m(key):
            x = C.values(R, n, lambda r: r["eval"]["wiki_ho"][key])
            return f"{C.mean_or_nan(x):.4g} ({'/'.join(f'{y:.4g}' for y in x)})"
        ms = C.values(R, n, lambda r: r["step_ms"])
        rows.append([n, arm["rank"] or "-", len(v), m("kl"), m("top1"), m("ppl"),
                     f"{C.mean_or_nan(ms):.0f}" if ms else "-"])
    lines += ["## Quality", "", f"{FORMAT}, {p['steps']} steps x {p['micro']} x {p['seq']} tokens, LR {p['lr']:g} "
              f"(LoRA x{p['lora_lr_factor']:g}) cosine; WIKI-HO {p['eval_windows']} windows of {p['eval_seq']}.", "",
              C.md_table(["arm", "rank", "seeds", "WIKI KL", "WIKI top-1", "WIKI PPL", "ms/step"], rows), "",
              "## Verdicts", ""] + C.verdict_lines(res.get("verdicts", []))
    lines += C.status_lines(R)
    C.write_text(out / f"{TAG}.md", "\n".join(lines) + "\n")
    C.write_json(out / f"{TAG}.json", res)

    def draw(fig):
        ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        labels = []
        for i, m in enumerate(x for x in res["memory"] if x.get("status") == "done"):
            src = m.get("parts") or {k: m["counted"].get(k, 0) for k in PARTS}
            bottom = 0.0
            for j, k in enumerate(PARTS):
                v = (src.get(k) or 0) / 2**20
                ax1.bar(i, v, bottom=bottom, color=f"C{j}", label=k if i == 0 else None)
                bottom += v
            if m.get("measured_peak") is not None:
                ax1.plot(i, m["measured_peak"] / 2**20, "k_", ms=18, label="measured peak" if i == 0 else None)
            labels.append(f"{m['arm']}\n{m['config']}")
        ax1.set_xticks(range(len(labels)), labels, fontsize=6)
        ax1.set_ylabel("MiB")
        ax1.legend(fontsize=6)
        ax1.set_title("memory by part", fontsize=9)
        for i, arm in enumerate(ARMS):
            v = C.values(R, arm["name"], lambda r: r["eval"]["wiki_ho"]["kl"])
            ax2.bar(i, C.mean_or_nan(v), color=f"C{i}")
            ax2.plot([i] * len(v), v, "k.", ms=4)
        ax2.set_xticks(range(len(ARMS)), [x["name"] for x in ARMS], fontsize=7)
        ax2.set_ylabel("WIKI-HO KL")
        ax2.set_title("quality; dots = seeds", fontsize=9)
        fig.suptitle("LoRA-QAD vs full QAD" + (" (SMOKE, measures nothing)" if res["smoke"] else ""), fontsize=10)
    C.plot(out / f"{TAG}.png", draw)


if __name__ == "__main__":
    sys.exit(main())
