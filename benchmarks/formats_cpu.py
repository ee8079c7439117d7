"""CPU quantize throughput of every registered format: torch emulator, numpy reference, and
(for formats with a ggml type) libggml's own C quantizer ``ggml_quantize_chunk`` in the same run.

    .venv/bin/python benchmarks/formats_cpu.py [--rows 4096] [--cols 4096] [--threads N] [--formats q4_k,...]

Prints one line per format (and per imatrix mode where the format takes one): M elements/s of
each path and ``C/emu``, how many times faster libggml is than our emulator (lower is better).
libggml's quantizer is single-threaded; ``--threads`` sets torch's intra-op threads (default:
torch's own choice), and ``--threads 1`` gives the like-for-like comparison.
A script, not a test: speed is never asserted.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from qatfactory.formats import get_format, list_formats  # noqa: E402


def _oracle():
    try:
        import ggml_oracle  # tests/ggml_oracle.py
        ggml_oracle._find_lib()
        return ggml_oracle
    except Exception as e:  # noqa: BLE001 - the table still shows the emulators
        print(f"# libggml unavailable ({e}); C column left empty")
        return None


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--formats", default="", help="comma-separated subset (default: all registered)")
    ap.add_argument("--no-ref", action="store_true", help="skip the (slow) numpy references")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    oracle = _oracle()
    by_type = {} if oracle is None else {v: k for k, v in oracle.GGML_TYPES.items()}
    names = [n for n in args.formats.split(",") if n] or list_formats()

    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((args.rows, args.cols)).astype(np.float32)
    x = torch.from_numpy(x_np)
    im_np = (rng.random(args.cols) + 0.01).astype(np.float32)
    n_m = x_np.size / 1e6
    print(f"# {args.rows}x{args.cols} float32, torch {torch.__version__} threads={torch.get_num_threads()}, "
          f"numpy {np.__version__}" + ("" if oracle is None else f", {oracle.version()}"))
    hdr = f"{'format':<16}{'imatrix':<9}{'emu M/s':>10}{'ref M/s':>10}{'C M/s':>10}{'C/emu':>8}{'C/ref':>8}"
    print(hdr)
    print("-" * len(hdr))
    for name in names:
        f = get_format(name)
        gname = by_type.get(f.spec.ggml_type) if f.spec.ggml_type is not None else None
        modes = [None]
        if gname == "q4_k":
            modes.append(im_np)
        for im in modes:
            kw = {} if im is None else {"imatrix": torch.from_numpy(im)}
            try:
                f.quantize(x[:8], **kw)          # warm-up (and: does it take an imatrix?)
            except TypeError:
                continue
            except NotImplementedError as e:
                print(f"{name:<16}{'-':<9}  not implemented: {e}")
                continue
            t_emu = _best(lambda: f.quantize(x, **kw), args.repeat)
            t_ref = None
            if not args.no_ref:
                try:
                    rkw = {} if im is None else {"imatrix": im}
                    t_ref = _best(lambda: f.quantize_ref(x_np, **rkw), args.repeat)
                except NotImplementedError:
                    t_ref = None
            t_c = None
            if gname is not None:
                t_c = _best(lambda: oracle.quantize(x_np, gname, im), max(args.repeat, 2))
            emu, ref = n_m / t_emu, (None if t_ref is None else n_m / t_ref)
            c = None if t_c is None else n_m / t_c
            fmt = lambda v: f"{v:10.2f}" if v is not None else f"{'-':>10}"  # noqa: E731
            rat = lambda a, b: f"{b / a:8.2f}" if (a and b) else f"{'-':>8}"  # noqa: E731
            print(f"{name:<16}{('yes' if im is not None else 'no'):<9}{fmt(emu)}{fmt(ref)}{fmt(c)}"
                  f"{rat(emu, c)}{rat(ref, c) if ref else f'{chr(45):>8}'}", flush=True)


if __name__ == "__main__":
    main()
