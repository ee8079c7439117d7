"""Fake-quant kernel bandwidth on the GPU, side by side with a device copy and the peers.

    python benchmarks/kernel_speed.py [--out DIR] [--quick]

Effective bandwidth = (bytes read + bytes written) / median time (triton.testing
do_bench_cudagraph: GPU time; do_bench eager time, with the Python launch, is listed too).
Forward fake quant reads x and writes y (2 x nbytes); the two-pass dynamic NVFP4 reads x
twice but is counted as 2 x nbytes like the others, so its ceiling is 2/3 of the copy;
backward (clipped STE) reads x and g and writes dx (3 x nbytes); quantize-only reads x and
writes codes + scales. Shapes: [8192, 8192] and [64, 2048, 7168] (MoE experts), bf16.
Peers, each if importable: ModelOpt fp4_fake_quant_block (Triton, NVFP4), torchao
NVFP4Tensor / MXTensor quantize + dequantize under torch.compile, and our torch emulator
under torch.compile. NVFP4 (nvfp4, nvfp4_act) is measured with the default kernel ($QF_NVFP4_KERNEL,
auto unless set) and, in the same run, with the old one (v1), v2 and the lane-exchange layout (v2x), whose
outputs on the benchmark tensor are also compared bit for bit. Writes kernels.json and kernels.md to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qatfactory import kernels as K  # noqa: E402
from qatfactory.formats import get_format  # noqa: E402


@contextlib.contextmanager
def nvfp4_kernel(version: str):
    """Run the block with $QF_NVFP4_KERNEL = version (read by every launch), then restore it."""
    old = os.environ.get("QF_NVFP4_KERNEL")
    os.environ["QF_NVFP4_KERNEL"] = version
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("QF_NVFP4_KERNEL", None)
        else:
            os.environ["QF_NVFP4_KERNEL"] = old


def bench(fn, warmup=5, rep=30):
    """(eager median ms, CUDA-graph median ms). Eager includes the Python launch cost; the
    graph replay leaves only GPU time (the number a captured training step sees)."""
    from triton.testing import do_bench, do_bench_cudagraph
    eager = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    try:
        graph = do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception:
        graph = None
    return eager, graph


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="first shape only, fewer peers")
    ap.add_argument("--rep", type=int, default=40, help="do_bench rep (ms of timing per entry)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    shapes = [(8192, 8192), (64, 2048, 7168)]
    if args.quick:
        shapes = shapes[:1]
    rows = []
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
            "cuda": torch.version.cuda}
    try:
        import cupy
        meta["cupy"] = cupy.__version__
    except Exception:
        pass
    try:
        import triton
        meta["triton"] = triton.__version__
    except Exception:
        pass

    def record(shape, name, impl, times, nbytes, note=""):
        eager, graph = times
        ms = graph if graph else eager
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append(dict(shape=list(shape), fmt=name, impl=impl, ms=ms, eager_ms=eager, graph_ms=graph,
                         GBps=gbs, note=note))
        print(f"{str(shape):>18} {name:<12} {impl:<36} graph {ms:8.3f} ms {gbs:6.0f} GB/s | eager {eager:8.3f} ms "
              f"{note}", flush=True)

    def attempt(shape, name, impl, fn, nbytes, note=""):
        try:
            fn()
            torch.cuda.synchronize()
            record(shape, name, impl, bench(fn, rep=args.rep), nbytes, note)
        except Exception as e:  # a peer that does not run is reported, not fatal
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            print(f"{str(shape):>18} {name:<12} {impl:<36} FAILED {msg}", flush=True)
            rows.append(dict(shape=list(shape), fmt=name, impl=impl, ms=None, eager_ms=None, graph_ms=None,
                             GBps=None, note=msg))
            if os.environ.get("BENCH_TRACE"):
                traceback.print_exc()

    def same_bits(shape, name, fn):
        """v1 == v2 == v2x on the benchmark tensor itself (a row with the count of differing elements)."""
        try:
            outs = {}
            for ver in K.NVFP4_KERNELS:
                with nvfp4_kernel(ver):
                    outs[ver] = fn().view(torch.int16)
            diff = {v: int((outs[v] != outs["v1"]).sum()) for v in outs if v != "v1"}
            print(f"   {name}: elements differing from v1: {diff}", flush=True)
            rows.append(dict(shape=list(shape), fmt=name, impl="NVFP4 kernels vs v1: differing elements",
                             ms=None, eager_ms=None, graph_ms=None, GBps=None, note=str(diff)))
        except Exception as e:
            print(f"   {name}: kernel comparison failed: {type(e).__name__}: {e}", flush=True)

    for shape in shapes:
        big = math.prod(shape) > 8192 * 8192     # the expert tensor: forward + backward + peers only
        torch.manual_seed(0)
        x = (torch.randn(shape, device=dev, dtype=torch.bfloat16) * 0.02)
        nb = x.numel() * x.element_size()
        y = torch.empty_like(x)
        attempt(shape, "copy", "torch copy_", lambda: y.copy_(x), 2 * nb)
        g = torch.randn_like(x)
        amax = x.float().abs().amax()
        amax_e = x.float().abs().amax(dim=tuple(range(1, x.ndim))) if x.ndim == 3 else amax
        for fmt in K.kernel_formats():
            f = get_format(fmt)
            kw = {"amax": amax_e} if fmt == "nvfp4" else ({"amax": amax} if fmt == "nvfp4_act" else {})
            note = "amax supplied" if kw else ""
            nv = fmt in ("nvfp4", "nvfp4_act")
            if nv:
                note = f"{note}; kernel {K.nvfp4_kernel_version()}"
            attempt(shape, fmt, "qatfactory CUDA fwd", lambda: K.fake_quantize(x, fmt, **kw), 2 * nb, note)
            if nv:
                # before/after in the same run: the old kernel (v1) and the lane-exchange layout (v2x)
                for ver, label in (("v1", "v1 (old kernel)"), ("v2", "v2 (thread per block)"),
                                   ("v2x", "v2x (lane exchange)")):
                    with nvfp4_kernel(ver):
                        attempt(shape, fmt, f"qatfactory CUDA fwd, {label}", lambda: K.fake_quantize(x, fmt, **kw),
                                2 * nb, note.split(";")[0])
                same_bits(shape, fmt, lambda: K.fake_quantize(x, fmt, **kw))
                attempt(shape, fmt, "qatfactory CUDA fwd (dynamic amax)", lambda: K.fake_quantize(x, fmt), 2 * nb,
                        "2 passes (amax, quantize; NVFP4 v2 adds a one-thread-per-group launch): floor = 2/3 of copy")
            if big and fmt not in ("nvfp4", "mxfp4"):
                continue
            if fmt not in ("q4_k", "q5_0", "q6_k"):
                a = K._amax_tensor(x, fmt, kw.get("amax")) if fmt in ("nvfp4", "nvfp4_act") else None
                attempt(shape, fmt, "qatfactory CUDA bwd (clipped STE)",
                        lambda: K._launch_fp4(x, fmt, a, 4, g=g), 3 * nb)
                if nv:
                    with nvfp4_kernel("v1"):
                        attempt(shape, fmt, "qatfactory CUDA bwd (clipped STE), v1 (old kernel)",
                                lambda: K._launch_fp4(x, fmt, a, 4, g=g), 3 * nb)
                cb = x.numel() // 2 + x.numel() // f.spec.block_size
                if not big:
                    attempt(shape, fmt, "qatfactory CUDA quantize-only", lambda: K._launch_fp4(x, fmt, a, 2), nb + cb)
                    if nv:
                        with nvfp4_kernel("v1"):
                            attempt(shape, fmt, "qatfactory CUDA quantize-only, v1 (old kernel)",
                                    lambda: K._launch_fp4(x, fmt, a, 2), nb + cb)
            else:
                rb = x.numel() // get_format(fmt).spec.super_block * get_format(fmt).spec.bytes_per_block
                attempt(shape, fmt, "qatfactory CUDA quantize-only", lambda: K._launch_ggml(x, fmt, 2), nb + rb)
            if fmt == "q4_k":
                for mb in (1, 2):
                    if mb == K.Q4K_MIN_BLOCKS:
                        continue
                    old, K.Q4K_MIN_BLOCKS = K.Q4K_MIN_BLOCKS, mb
                    attempt(shape, fmt, f"qatfactory CUDA fwd, launch_bounds(256,{mb})",
                            lambda: K.fake_quantize(x, fmt), 2 * nb)
                    K.Q4K_MIN_BLOCKS = old
            if not args.quick or fmt in ("nvfp4", "mxfp4"):
                if big and fmt != "nvfp4":
                    continue          # keeps the GPU run within its time limit
                emu = torch.compile(lambda t: f.fake_quantize(t, **kw), dynamic=False)
                attempt(shape, fmt, "our emulator, torch.compile", lambda: emu(x), 2 * nb)

        # ------------------------------------------------------------------ peers
        try:
            from modelopt.torch.kernels.quantization.gemm.fp4_kernel_hopper import fp4_fake_quant_block
            attempt(shape, "nvfp4", "ModelOpt fp4_fake_quant_block", lambda: fp4_fake_quant_block(x, amax), 2 * nb)
            ref = fp4_fake_quant_block(x, amax)
            ours = K.fake_quantize(x, "nvfp4", amax=amax)
            diff = int((ref.view(torch.int16) != ours.view(torch.int16)).sum())
            print(f"   ModelOpt fake quant vs ours (same amax): {diff} of {x.numel()} elements differ "
                  f"(ModelOpt flushes blocks with s < 1e-5 and takes -0 as +0, formats.md 1.2)", flush=True)
            rows.append(dict(shape=list(shape), fmt="nvfp4", impl="ModelOpt vs ours: differing elements",
                             ms=None, eager_ms=None, graph_ms=None, GBps=None, note=str(diff)))
        except Exception as e:
            print("ModelOpt peer unavailable:", type(e).__name__, str(e)[:200], flush=True)
        try:
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
            pts = per_tensor_amax_to_scale(amax)
            x2 = x.reshape(-1, x.shape[-1])

            def ao_nvfp4(t):
                return NVFP4Tensor.to_nvfp4(t, per_tensor_scale=pts).dequantize(torch.bfloat16)

            c = torch.compile(ao_nvfp4)
            attempt(shape, "nvfp4", "torchao NVFP4Tensor, torch.compile", lambda: c(x2), 2 * nb)
        except Exception as e:
            print("torchao NVFP4 peer unavailable:", type(e).__name__, str(e)[:200], flush=True)
        try:
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import MXTensor
            x2 = x.reshape(-1, x.shape[-1])
            for mode, name in ((ScaleCalculationMode.FLOOR, "mxfp4"), (ScaleCalculationMode.RCEIL, "mxfp4_rceil")):
                def ao_mx(t, mode=mode):
                    return MXTensor.to_mx(t, torch.float4_e2m1fn_x2, 32, scaling_mode=mode).dequantize(torch.bfloat16)

                c = torch.compile(ao_mx)
                attempt(shape, name, "torchao MXTensor, torch.compile", lambda: c(x2), 2 * nb)
        except Exception as e:
            print("torchao MX peer unavailable:", type(e).__name__, str(e)[:200], flush=True)
        del x, y, g
        torch.cuda.empty_cache()

        write_report(out, meta, rows, echo=False)
    write_report(out, meta, rows, echo=True)


def write_report(out: Path, meta: dict, rows: list, echo: bool = True) -> None:
    """kernels.json + kernels.md; called after every shape, so a timeout keeps what ran."""
    copy = {tuple(r["shape"]): r["GBps"] for r in rows if r["fmt"] == "copy" and r["GBps"]}
    for r in rows:
        c = copy.get(tuple(r["shape"]))
        r["vs_copy"] = (r["GBps"] / c) if (c and r["GBps"]) else None
    (out / "kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"GPU {meta['gpu']}, torch {meta['torch']}, CUDA {meta.get('cuda')}, CuPy {meta.get('cupy')}, "
             f"Triton {meta.get('triton')}, {meta['date']}", "",
             "GB/s and 'vs copy' from the CUDA-graph median (GPU time); 'eager ms' adds the Python launch.", "",
             "| shape | format | implementation | graph ms | eager ms | GB/s | vs copy | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['ms']:.3f}" if r["ms"] else "-"
        em = f"{r['eager_ms']:.3f}" if r.get("eager_ms") else "-"
        gb = f"{r['GBps']:.0f}" if r["GBps"] else "-"
        vc = f"{100 * r['vs_copy']:.1f}%" if r.get("vs_copy") else "-"
        lines.append(f"| {'x'.join(map(str, r['shape']))} | {r['fmt']} | {r['impl']} | {ms} | {em} | {gb} | {vc} | "
                     f"{r['note']} |")
    (out / "kernels.md").write_text("\n".join(lines) + "\n")
    if echo:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
