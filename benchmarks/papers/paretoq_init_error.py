"""How far ParetoQ's initial scales are from a good PTQ (shared/reference/paretoq.md 1.7, re-measured with
our quantizers): relative weight error ||W_hat - W|| / ||W|| of every grid at ParetoQ's init and at the
MSE-searched alpha (nn/lowbit.py ``mse``: 61 multiples 0.05..1.25 of the init, per row, on the grid the
engine stores), averaged over the seven linears of a few layers. CPU, no training.

    python benchmarks/papers/paretoq_init_error.py --out benchmarks/results/paretoq_init_error_cpu_20261201   # SmolLM2-135M
    python benchmarks/papers/paretoq_init_error.py --smoke --out /tmp/pq-init                   # random weights

Writes ``paretoq_init_error.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paretoq_common as C  # noqa: E402

GRIDS = [("4 (LSQ)", "int4_lsq"), ("3 (LSQ)", "int3_lsq_q4_0"), ("2 (SEQ)", "int2_seq_q4_0"),
         ("2 (LSQ)", "int2_lsq_q4_0"), ("1.58 (SEQ)", "ternary_seq_q4_0"), ("1 (sign)", "binary_sign_q4_0")]
LAYERS = (0, 7, 15, 23, 29)


def weights(smoke: bool, model_path: Optional[str]) -> Dict[str, torch.Tensor]:
    if smoke:
        g = torch.Generator().manual_seed(0)
        return {f"w{i}": torch.randn(64, 256, generator=g) * 0.02 for i in range(4)}
    from safetensors.torch import load_file
    from qatfactory import assets
    d = Path(model_path or assets.prepare_model_dir("smollm2"))
    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    leaves = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {k: v.float() for k, v in sd.items() if k.endswith(".weight") and k.split(".")[-2] in leaves
            and int(k.split(".")[2]) in LAYERS}


def rel_err(fmt_name: str, w: torch.Tensor, method: str) -> float:
    from qatfactory.nn.lowbit import LowBitQuantizer
    q = LowBitQuantizer(fmt_name, "frozen", (1, *w.shape))
    q.init_state(w.unsqueeze(0), method)
    with torch.no_grad():
        y = q(w.unsqueeze(0))[0]
    return float((y - w).norm() / w.norm())


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args(argv)
    ws = weights(args.smoke, args.model_path)
    rows, res = [], {"smoke": args.smoke, "env": C.environment(), "tensors": len(ws), "grids": {}}
    for label, fmt in GRIDS:
        init = statistics.fmean(rel_err(fmt, w, "max") for w in ws.values())
        best = statistics.fmean(rel_err(fmt, w, "mse") for w in ws.values())
        res["grids"][label] = {"format": fmt, "paretoq_init": init, "mse": best}
        rows.append([label, fmt, init, best])
    what = "SMOKE: random N(0, 0.02) weights; measures nothing" if args.smoke else \
        f"SmolLM2-135M-Instruct, {len(ws)} linear weights of layers {', '.join(map(str, LAYERS))}"
    text = [f"# ParetoQ init vs MSE-searched scales ({what})", "", f"{res['env']['date']}, CPU.", "",
            C.md_table(["bits (grid)", "format", "rel. error at ParetoQ init", "rel. error, MSE alpha"], rows)]
    C.write_text(args.out / "paretoq_init_error.md", "\n".join(text) + "\n")
    C.write_json(args.out / "paretoq_init_error.json", res)
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
