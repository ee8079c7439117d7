"""Export time and peak memory for a ~1B random Llama-shaped model, against save_pretrained of the
same model in bf16, all in one run (each measurement in its own subprocess so peaks do not mix).

    .venv/bin/python benchmarks/export.py                 # ~1.0B params (hidden 2048, 20 layers)
    .venv/bin/python benchmarks/export.py --layers 2      # quick smoke run
    .venv/bin/python benchmarks/export.py --json out.json

Measured per target: wall time of the call alone, extra resident memory at its peak (RSS sampled
every 5 ms, minus RSS just before the call; glibc's mmap threshold is pinned so freed memory is
not silently reused), tracemalloc's peak (numpy/Python allocations), and bytes on disk. The
student is quantized to NVFP4 (the exporters' input, built once per subprocess and not timed);
GGUF receives the same NVFP4 tensors repacked into GGML NVFP4 blocks, so all three exports move
the same codes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TARGETS = ["save_pretrained_bf16", "vllm_modelopt", "vllm_compressed_tensors", "llama_cpp_gguf"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident memory above the level at entry, plus tracemalloc's peak (numpy and Python
    allocations; torch's own CPU allocations are invisible to it)."""

    def __enter__(self):
        import tracemalloc
        tracemalloc.start()
        self.base = _rss()
        self.peak = self.base
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        import tracemalloc
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, _rss())
        self.traced_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def build_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inter,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=8,
                      max_position_embeddings=4096, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():  # cheap random init (normal_ on 1B params is slow on 2 cores)
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.copy_((torch.rand(p.shape, generator=g, dtype=torch.float32) - 0.5).mul_(0.06))
    return model


def converted_from(model):
    """NVFP4 ConvertedModel with shared q/k/v and gate/up amax (what quantize.convert hands over)."""
    import re

    import torch

    from qatfactory.formats import ConvertedModel, get_format

    sd = dict(model.state_dict())
    lin = [k for k, v in sd.items() if ".layers." in k and k.endswith(".weight") and v.ndim == 2]

    def gkey(k):
        return re.sub(r"\.(q_proj|k_proj|v_proj)\.", ".qkv.", re.sub(r"\.(gate_proj|up_proj)\.", ".gu.", k))

    amax = {}
    for k in lin:
        amax[gkey(k)] = max(amax.get(gkey(k), 0.0), float(sd[k].abs().max()))
    f = get_format("nvfp4")
    packed = {k: f.quantize(sd.pop(k), amax=torch.tensor(amax[gkey(k)])) for k in lin}
    return ConvertedModel(packed=packed, dense=sd, config=model.config.to_dict(),
                          quant={"weight_format": "nvfp4"}, recipe={"benchmark": "random init"})


def run_one(target: str, args) -> dict:
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t0 = time.time()
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    t_build = time.time() - t0
    out_root = Path(tempfile.mkdtemp(prefix="qf-bench-", dir=args.workdir))
    out = out_root / target
    if target == "save_pretrained_bf16":
        with PeakRSS() as m:
            t = time.time()
            model.save_pretrained(str(out))
            dt = time.time() - t
        t_quant = 0.0
    else:
        from qatfactory.exporters import export
        t = time.time()
        cm = converted_from(model)
        del model
        t_quant = time.time() - t
        engine, flavour = {"vllm_modelopt": ("vllm", "modelopt"),
                           "vllm_compressed_tensors": ("vllm", "compressed-tensors"),
                           "llama_cpp_gguf": ("llama_cpp", "gguf")}[target]
        with PeakRSS() as m:
            t = time.time()
            export(cm, out, engine=engine, flavour=flavour)
            dt = time.time() - t
    size = _du(out)
    import shutil
    shutil.rmtree(out_root, ignore_errors=True)
    return {"target": target, "params": n_params, "seconds": round(dt, 2),
            "peak_extra_mib": round((m.peak - m.base) / 2**20, 1),
            "traced_peak_mib": round(m.traced_peak / 2**20, 1),
            "rss_before_mib": round(m.base / 2**20, 1), "disk_mib": round(size / 2**20, 1),
            "build_s": round(t_build, 1), "quantize_s": round(t_quant, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--targets", nargs="*", default=TARGETS, choices=TARGETS)
    ap.add_argument("--workdir", default=None, help="where the outputs are written (deleted after measuring)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._one:
        print(json.dumps(run_one(args._one, args)))
        return 0
    rows = []
    for t in args.targets:
        cmd = [sys.executable, os.path.abspath(__file__), "--_one", t, "--hidden", str(args.hidden), "--inter",
               str(args.inter), "--layers", str(args.layers), "--vocab", str(args.vocab)]
        if args.workdir:
            cmd += ["--workdir", args.workdir]
        # a fixed mmap threshold: glibc otherwise keeps freed blocks (of the untimed quantization)
        # in its heap and the export reuses them without raising RSS, hiding its real footprint
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{t} failed")
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"{t:26s} {rows[-1]['seconds']:8.2f} s  peak RSS +{rows[-1]['peak_extra_mib']:8.1f} MiB  "
              f"traced peak {rows[-1]['traced_peak_mib']:8.1f} MiB  "
              f"disk {rows[-1]['disk_mib']:8.1f} MiB  (quantize {rows[-1]['quantize_s']} s, not timed)", flush=True)
    print(f"params: {rows[0]['params'] / 1e9:.3f} B")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
