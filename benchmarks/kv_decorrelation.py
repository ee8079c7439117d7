"""Does an FP8 KV cache's rounding stay shared between two forwards that differ a little? On a CPU.

vLLM serving our fp8_e4m3 export sat 0.019 nats (KL) from every student variant, its bf16 cache 0.0019 from the
student's bf16 forward (results/kv_vllm_h100_20261206_bf16_control). The cache write itself is bit-exact: vLLM's own
reshape_and_cache op stores the bytes our rule computes for the same K and V (0 of 263,168 differ, same run).
The hypothesis measured here: the engine's K and V are not the student's K and V. They differ a little
(its bf16 kernels, NVFP4 Marlin GEMMs, fused RoPE), and the E4M3 grid is coarse (3 mantissa bits). So a
difference of a fraction of an E4M3 step already moves many elements to the other neighbour, and the two
sides' FP8 errors stop being the same error.

Setup. SmolLM2-135M-Instruct in fp32 on CPU (packaged GGUF); held-out Wikipedia windows. Forward A is the
model. Forward B is the model with every attention layer's k_proj and v_proj output scaled elementwise by
(1 + eps * n), n ~ N(0, 1), fixed per layer, projection and position: a stand-in for the engine's kernel
differences. Each runs with its cache unquantized (fp32) and with the fp8_e4m3 cache emulation
(`quant.kv_attention=none`, per-layer scales calibrated once, max, on A's K and V of calibration articles; B
uses the same scales, as the engine loads the exported ones). Reported per eps:

* KL(A || B): the floor, what the two forwards differ by without FP8;
* KL(A || A8), KL(B || B8): each side's FP8 error;
* KL(A8 || B8): what the FP8 student and the FP8 "engine" differ by. Shared FP8 errors would keep it near
  KL(A || B); independent ones put it near KL(A || A8) + KL(B || B8);
* the fraction of K and V elements (all layers) whose E4M3 value differs between A8 and B8, and the median
  relative difference |K_B - K_A| / |K_A| of the unquantized K (the last layer).

    python benchmarks/kv_decorrelation.py --out benchmarks/results/kv_decorrelation_cpu_20261206      # ~5 min, 2 cores

Writes kv_decorrelation.json, .md and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def say(msg: str) -> None:
    print(f"[kv-decorrelation] {msg}", flush=True)


class Perturb:
    """Forward hooks on every k_proj / v_proj: out * (1 + eps * n), n fixed per (layer, projection, shape)."""

    def __init__(self, model, eps: float, seed: int = 1234):
        self.eps, self.seed, self.handles = float(eps), int(seed), []
        self.noise: Dict[tuple, torch.Tensor] = {}
        for i, layer in enumerate(model.model.layers):
            for which in ("k_proj", "v_proj"):
                mod = getattr(layer.self_attn, which)
                self.handles.append(mod.register_forward_hook(self._hook(i, which)))

    def _hook(self, i: int, which: str):
        def hook(_mod, _inp, out):
            if self.eps == 0.0:
                return out
            key = (i, which, tuple(out.shape))
            if key not in self.noise:
                g = torch.Generator().manual_seed(self.seed + 97 * i + (1 if which == "v_proj" else 0))
                self.noise[key] = torch.randn(out.shape, generator=g, dtype=torch.float32)
            return out * (1.0 + self.eps * self.noise[key].to(out.dtype))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Capture:
    """The fake-quantized (or pass-through) K and V each layer's KV quantizer hands to attention."""

    def __init__(self, quantizers):
        self.kv: Dict[str, tuple] = {}
        self.handles = [q.register_forward_hook(self._hook(n)) for n, q in quantizers]

    def _hook(self, name: str):
        def hook(_mod, _inp, out):
            self.kv[name] = (out[0].detach().clone(), out[1].detach().clone())
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over the masked positions of KL(p || q), full vocabulary, in fp64."""
    lp = F.log_softmax(p_logits.double(), -1)
    lq = F.log_softmax(q_logits.double(), -1)
    k = (lp.exp() * (lp - lq)).sum(-1)
    return float(k[mask].mean())


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model-path", default=None, help="a local HF model directory (default: packaged SmolLM2)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--n-eval", type=int, default=4)
    ap.add_argument("--n-calib", type=int, default=4)
    ap.add_argument("--eps", default="0,0.001,0.003,0.01,0.03")
    ap.add_argument("--scale-rules", action="store_true",
                    help="also: the same forward (eps 0) with the old float32 scales amax / 448 against those scales as "
                         "vLLM holds them in a bf16 model (rounded to nearest bf16), and against today's (rounded up)")
    ap.add_argument("--threads", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qatfactory import assets
    from qatfactory.nn import kv_cache as KV

    t0 = time.time()
    d = Path(a.model_path or assets.prepare_model_dir("smollm2"))
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa").eval()
    split = assets.wiki_splits(seed=0)

    def windows(texts: List[str], n: int) -> torch.Tensor:
        ids = tok("\n\n".join(texts), return_tensors="pt")["input_ids"][0]
        need = n * a.seq
        if ids.numel() < need:
            raise SystemExit(f"the texts hold {ids.numel()} tokens, fewer than {n} x {a.seq}")
        return ids[:need].reshape(n, a.seq)

    ev, cal = windows(split["eval"], a.n_eval), windows(split["calib"], a.n_calib)
    KV.attach(model, "fp8_e4m3", "frozen", "none")
    quant = KV.kv_quantizers(model)
    with torch.no_grad():
        for _, q in quant:
            q.start_calibration("max")
        for row in cal:
            model(row[None])
        amax = {n: q.finish_calibration() for n, q in quant}
    say(f"calibrated {len(quant)} layers' K/V scales (max) on {a.n_calib} x {a.seq} tokens")

    def run(eps: float, fp8: bool):
        """Logits [n, seq, vocab] and the K/V each layer received, for one forward variant."""
        for _, q in quant:
            q.calibrating = None if fp8 else "pass"
        pert, cap = Perturb(model, eps), Capture(quant)
        logits, kv = [], []
        try:
            with torch.no_grad():
                for row in ev:
                    logits.append(model(row[None]).logits[0].float())
                    kv.append(dict(cap.kv))
        finally:
            pert.remove()
            cap.remove()
        return torch.stack(logits), kv

    mask = torch.ones(a.n_eval, a.seq, dtype=torch.bool)
    base, base8 = run(0.0, False), run(0.0, True)
    last = quant[-1][0]
    rows = []
    for eps in [float(x) for x in a.eps.split(",")]:
        b, b8 = run(eps, False), run(eps, True)
        differ = total = 0
        for kv_a, kv_b in zip(base8[1], b8[1]):
            for n in kv_a:
                for ta, tb in zip(kv_a[n], kv_b[n]):
                    differ += int((ta != tb).sum())
                    total += ta.numel()
        ka = torch.cat([x[last][0].flatten() for x in base[1]])
        kb = torch.cat([x[last][0].flatten() for x in b[1]])
        big = ka.abs() > 1e-3 * ka.abs().max()
        rel = float(((kb - ka).abs()[big] / ka.abs()[big]).median())
        r = {"eps": eps, "kl_a_b": kl(base[0], b[0], mask), "kl_a_a8": kl(base[0], base8[0], mask),
             "kl_b_b8": kl(b[0], b8[0], mask), "kl_a8_b8": kl(base8[0], b8[0], mask),
             "e4m3_elements_differ": differ / total, "k_rel_diff_median_last_layer": rel}
        ind = r["kl_a_a8"] + r["kl_b_b8"]
        r["shared_fraction"] = (ind - r["kl_a8_b8"]) / ind if ind > 0 else float("nan")
        rows.append(r)
        say(json.dumps({k: round(v, 6) for k, v in r.items()}))
    scale_rows = scale_rule_rows(run, base, mask) if a.scale_rules else []
    res = {"model": str(d.name), "seq": a.seq, "n_eval": a.n_eval, "n_calib": a.n_calib, "threads": a.threads,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "seconds": time.time() - t0, "kv_amax_first_layer": next(iter(amax.values())), "rows": rows,
           "scale_rows": scale_rows}
    report(a.out, res)
    return 0


SCALE_RULES = {
    "float32 amax/448 (before 2026-12-06)": lambda q: q,
    "vLLM's bf16 parameter of that (nearest)": lambda q: q.to(torch.bfloat16).float(),
    "bf16, rounded up (qatfactory now)": None,          # the library's own rule, unpatched
}


def scale_rule_rows(run, base, mask) -> List[Dict[str, Any]]:
    """eps 0, the fp8 cache with each scale rule of SCALE_RULES applied to ModelOpt's float32 amax / 448 (the
    quantizers ask the format for fmt.scale(amax); the rule is swapped in the format's module for the run):
    KL to the unquantized forward and to the first rule's forward."""
    from qatfactory.formats import kv as KVF
    from qatfactory.formats import kv_fp8

    keep = kv_fp8.amax_over_448

    def patched(rule):
        return lambda name, amax: rule(KVF.modelopt_kv_scale(name, amax))

    outs, rows = {}, []
    for label, rule in SCALE_RULES.items():
        kv_fp8.amax_over_448 = keep if rule is None else patched(rule)
        try:
            outs[label] = run(0.0, True)
        finally:
            kv_fp8.amax_over_448 = keep
    first = next(iter(outs))
    for label, (logits, _kv) in outs.items():
        r = {"rule": label, "kl_to_unquantized": kl(base[0], logits, mask),
             "kl_to_first_rule": kl(outs[first][0], logits, mask)}
        rows.append(r)
        say(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}))
    return rows


def report(out: Path, res: Dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "kv_decorrelation.json.tmp"
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(out / "kv_decorrelation.json")
    head = "| eps | KL(A‖B) | KL(A‖A8) | KL(B‖B8) | KL(A8‖B8) | shared part of the FP8 errors | E4M3 values that differ | median rel. K diff, last layer |"
    lines = [f"# FP8 KV rounding under small differences ({res['date']}, CPU, torch {res['torch']})", "",
             f"{res['model']} in fp32, {res['n_eval']} held-out windows of {res['seq']} tokens; fp8_e4m3 cache "
             f"emulation with max-calibrated per-layer scales ({res['n_calib']} calibration windows); "
             f"{res['seconds']:.0f} s.", "", head, "|" + "---|" * 8]
    for r in res["rows"]:
        lines.append(f"| {r['eps']:g} | {r['kl_a_b']:.5f} | {r['kl_a_a8']:.5f} | {r['kl_b_b8']:.5f} | "
                     f"{r['kl_a8_b8']:.5f} | {r['shared_fraction']:.2f} | {r['e4m3_elements_differ']:.4f} | "
                     f"{r['k_rel_diff_median_last_layer']:.4f} |")
    lines += ["", "shared part = 1 - KL(A8‖B8) / (KL(A‖A8) + KL(B‖B8)): 1 when both sides make the same FP8 "
              "error, about 0 when the errors are independent (a rough reading: KL is not a squared distance)."]
    if res.get("scale_rows"):
        first = res["scale_rows"][0]["rule"]
        lines += ["", "The same forward (eps 0) with the fp8 cache under three rules for the per-layer scale, from the same "
                  "calibrated amax:", "",
                  f"| scale rule | KL(A‖A8) | KL(A8 with {first} ‖ this) |", "|---|---|---|"]
        lines += [f"| {r['rule']} | {r['kl_to_unquantized']:.5f} | {r['kl_to_first_rule']:.5f} |"
                  for r in res["scale_rows"]]
    tmp = out / "kv_decorrelation.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out / "kv_decorrelation.md")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rr = [r for r in res["rows"] if r["eps"] > 0]
    if not rr:
        return                                        # nothing to draw (eps 0 only)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    x = [r["eps"] for r in rr]
    ax.loglog(x, [r["kl_a_b"] for r in rr], "o-", label="KL(A‖B): no FP8 (the floor)")
    ax.loglog(x, [r["kl_a8_b8"] for r in rr], "s-", label="KL(A8‖B8): both with the FP8 cache")
    ax.loglog(x, [r["kl_a_a8"] + r["kl_b_b8"] for r in rr], "--", color="gray",
              label="KL(A‖A8) + KL(B‖B8): independent FP8 errors")
    ax.set_xlabel("eps (relative perturbation of K and V)")
    ax.set_ylabel("KL, nats per token")
    ax.legend(fontsize=7)
    ax.set_title("FP8 KV-cache errors under small forward differences", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "kv_decorrelation.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
