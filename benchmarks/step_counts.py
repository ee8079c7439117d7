"""Where a training step's host work goes, counted on a CPU: launches and host reads per phase.

The H200 profile of benchmarks/step.py says our steps are host-bound (the GPU idle 24-54 ms per step,
4,158 launches per bf16 SFT step against 2,465 for a plain fp32-master loop). A launch is an aten op the
host issues, and a host read (``.item()``, ``bool(t)``, ``.cpu()``, ``.tolist()``, a device synchronize)
stops the host until the GPU has drained its queue; both can be counted without a GPU, per phase of the
step, in the real trainer run as step.py configures it (benchmarks/lowbit_step.py's method):

    python benchmarks/step_counts.py                       # the table (SFT, QAT W4A16, W4A4, live QAD, peer)
    python benchmarks/step_counts.py --variants "SFT" --json out.json
    python benchmarks/step_counts.py --levers              # also each step lever (step.py's rows)

Model: step.py's Llama at the same depth (16 layers x 7 linears, untied head) and a small width (hidden
64; op counts depend on the layer count, not the width), batch 4 x 32 with the loss in 4 chunks as at
4 x 2048 with ``chunk_tokens=2048``. Each variant is step.py's own (``step.variants``) through
``step.one`` (the trainer, DeepSpeed ZeRO-0 bf16), with one change so that DeepSpeed takes the GPU's
optimizer path: the torch AdamW the trainer builds on a CPU is swapped for a FusedAdam whose kernel is
foreach ops (benchmarks/fused_adam_cpu.py), so ZeRO-0 bf16 is ``FP16_Optimizer`` as on the H200. The
plain fp32-master loop is benchmarks/step_peers.py's, on the same shape, with torch's fused AdamW.

Counted per optimizer step (steps ``skip+1 .. skip+steps``), per phase (the innermost of: ``teacher``
forward, student ``forward``, ``loss``, ``backward`` (autograd), DeepSpeed's ``ds_forward`` /
``ds_backward`` (the engine around them: hooks, gradient all-reduce) / ``ds_step`` (overflow check,
flatten, norm, clip, fp32->bf16 copies, zero_grad, LR scheduler) / ``adam`` (the optimizer kernel),
ours: ``weights_changed`` (the per-step cache invalidation), ``data`` (the batch), ``loop`` (the rest of
our loop: loss accumulation, its host read, metrics, logging)):

* launches: top-level aten ops that launch a kernel on a GPU (views, allocations and metadata left
  out; lowbit_step.NO_KERNEL). CPU proxy: a CPU runs the format emulators where a GPU runs one fused
  kernel per fake quant (forward / backward of quantized rows differ on CUDA); a ``_foreach_*`` op
  counts once where CUDA launches one kernel per 320 chunks (FusedAdam: ``fused_adam_cpu.cuda_launches``);
  c10d collectives are counted apart (gloo here, NCCL there).
* host reads: aten::_local_scalar_dense (``item``, ``bool``, ``float`` of a tensor), aten::equal, the
  ops a GPU answers only after a sync (aten::nonzero, masked_select, unique), the device->host copies
  asked for from Python (``.cpu()``, ``.tolist()``, ``.numpy()`` of a tensor that lives on the device in
  a GPU run), and DeepSpeed's accelerator ``synchronize()`` (a no-op on a CPU, a full device sync on a
  GPU). A ``float()`` of a tensor already copied to the host is a read on a CPU but not on a GPU: the
  call sites say which.

Not a test and not a timing: nothing is asserted and no CPU time says anything about a GPU.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from lowbit_step import NO_KERNEL, SYNC_OPS  # noqa: E402

# ops that return a host value on a GPU only after waiting for the device (besides _local_scalar_dense)
SYNC_ON_CUDA = ("aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_consecutive",
                "aten::unique_dim")
PHASES = ("teacher", "forward", "loss", "backward", "ds_forward", "ds_backward", "ds_step", "adam",
          "weights_changed", "data", "loop")
LAYERS, HIDDEN, INTER, VOCAB = 16, 64, 176, 512
THIN = ["model=tiny_llama", "model.dtype=bfloat16", f"model.tiny.vocab_size={VOCAB}",
        f"model.tiny.hidden_size={HIDDEN}", f"model.tiny.intermediate_size={INTER}",
        f"model.tiny.num_hidden_layers={LAYERS}", "model.tiny.num_attention_heads=4",
        "model.tiny.num_key_value_heads=2", "model.tiny.tie_word_embeddings=false"]
THIN_SHAPE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
DEFAULT_VARIANTS = "bf16 SFT (no quant, CE)|QAT W4A16 (CE)|QAT W4A4 (CE)|QAD W4A16 live teacher"
PEER = "plain loop, fp32 masters"
LEVER_ROWS = ("bf16 SFT, ZeRO-1", "bf16 SFT, ZeRO-1 BF16_Optimizer (fp32 grads, immediate update)",
              "QAD W4A16 live teacher, lean activations")

_TLS = threading.local()


def _phase_now() -> str:
    st = getattr(_TLS, "stack", None)
    return st[-1] if st else "loop"


@contextlib.contextmanager
def phase(name: str):
    from torch.profiler import record_function
    st = getattr(_TLS, "stack", None)
    if st is None:
        st = _TLS.stack = []
    st.append(name)
    try:
        with record_function("qf:" + name):
            yield
    finally:
        st.pop()


def _wrap(owner, attr: str, name: str, patches: list) -> None:
    """Run ``owner.attr`` inside ``phase(name)`` (undone by _unpatch)."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def inner(*a, **kw):
        with phase(name):
            return fn(*a, **kw)
    patches.append((owner, attr, fn))
    setattr(owner, attr, inner)


def _unpatch(patches: list) -> None:
    for owner, attr, fn in reversed(patches):
        setattr(owner, attr, fn)
    patches.clear()


def _site() -> str:
    """The first caller frame outside torch and this file: file:line function."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        f = fr.filename
        if "/torch/" in f or f.endswith("step_counts.py") or "/contextlib.py" in f or "/functools.py" in f:
            continue
        short = f.split("site-packages/")[-1] if "site-packages/" in f else os.path.relpath(f, REPO)
        return f"{short}:{fr.lineno} {fr.name}"
    return "?"


class HostCalls:
    """Python-level device->host traffic: Tensor.cpu / tolist / numpy, and the DeepSpeed accelerator's
    synchronize, counted per phase with their call sites (only while ``active``)."""

    def __init__(self):
        self.active = False
        self.counts = collections.Counter()       # (phase, kind) -> n
        self.sites = collections.Counter()        # (phase, kind, site) -> n
        self.patches: list = []

    def _note(self, kind: str) -> None:
        if self.active:
            ph = _phase_now()
            self.counts[(ph, kind)] += 1
            self.sites[(ph, kind, _site())] += 1

    def __enter__(self):
        import torch
        from deepspeed.accelerator import get_accelerator
        # d2h: copies to the host asked for from Python; scalar: item / bool / float / int of a tensor
        # (counted by the profiler as aten::_local_scalar_dense; noted here for the call site only)
        for attr, kind in (("cpu", "d2h cpu"), ("tolist", "d2h tolist"), ("numpy", "d2h numpy"),
                           ("item", "scalar"), ("__bool__", "scalar"), ("__float__", "scalar"),
                           ("__int__", "scalar"), ("__index__", "scalar")):
            fn = getattr(torch.Tensor, attr)

            def make(fn, kind):
                def inner(t, *a, **kw):
                    self._note(kind)
                    return fn(t, *a, **kw)
                return inner
            self.patches.append((torch.Tensor, attr, fn))
            setattr(torch.Tensor, attr, make(fn, kind))
        acc = get_accelerator()
        sync = acc.synchronize

        def synchronize(*a, **kw):
            self._note("device synchronize")
            return sync(*a, **kw)
        self.patches.append((acc, "synchronize", sync))
        acc.synchronize = synchronize
        return self

    def __exit__(self, *exc):
        _unpatch(self.patches)
        return False


def _kernel_like(ev) -> bool:
    if not ev.name.startswith("aten::") or ev.name in NO_KERNEL:
        return False
    p = ev.cpu_parent
    while p is not None:
        if p.name.startswith("aten::") and p.name not in NO_KERNEL:
            return False
        p = p.cpu_parent
    return True


def _event_phase(ev) -> str:
    p = ev
    while p is not None:
        if p.name.startswith("qf:"):
            return p.name[3:]
        if p.name.startswith("Optimizer.step#"):
            return "adam"
        if p.name.startswith("autograd::engine::evaluate_function"):
            # an autograd node outside a backward we wrapped (the peer's loss.backward())
            return "backward"
        p = p.cpu_parent
    return "loop"


class Counts:
    """The profiler's CPU ops of a window of ``steps`` optimizer steps, by phase; ``step_now()`` marks
    the start of each step (a point outside every phase)."""

    def __init__(self, skip: int, steps: int):
        from torch.profiler import ProfilerActivity, profile, schedule
        self.skip, self.steps = skip, steps
        self.n = 0
        self.host = HostCalls()
        self.launch = collections.Counter()       # phase -> n
        self.ops = collections.Counter()          # (phase, op) -> n
        self.reads = collections.Counter()        # (phase, op) -> n
        self.comm = collections.Counter()         # (phase, name) -> n
        self.done = False
        self.prof = profile(activities=[ProfilerActivity.CPU],
                            schedule=schedule(wait=skip, warmup=1, active=steps, repeat=1),
                            on_trace_ready=self._ready)

    def step_now(self) -> None:
        self.n += 1
        # the Python-level counters follow the profiler's recording window (its step numbers skip+1 ..
        # skip+steps: schedule(wait=skip, warmup=1, active=steps))
        self.host.active = self.skip + 1 <= self.n <= self.skip + self.steps
        self.prof.step()

    def _ready(self, prof) -> None:
        for ev in prof.events():
            name = ev.name
            if name.startswith(("c10d::", "gloo:", "nccl:")) or name in ("record_param_comms",):
                self.comm[(_event_phase(ev), name)] += 1
                continue
            if not name.startswith("aten::"):
                continue
            if name in SYNC_OPS or name in SYNC_ON_CUDA:
                ph = _event_phase(ev)
                self.reads[(ph, name)] += 1
            if _kernel_like(ev):
                ph = _event_phase(ev)
                self.launch[ph] += 1
                self.ops[(ph, name)] += 1
        self.done = True

    def result(self) -> dict:
        s = float(self.steps)
        per = lambda c: {k: v / s for k, v in sorted(c.items(), key=lambda kv: -kv[1])}   # noqa: E731
        reads = collections.Counter()
        for (ph, _), v in self.reads.items():
            reads[ph] += v
        for (ph, kind), v in self.host.counts.items():
            if kind != "scalar":
                reads[ph] += v
        sites = collections.Counter()
        for (ph, kind, site), v in self.host.sites.items():
            sites[f"{ph} | {kind} | {site}"] += v
        # reads the Python calls above do not explain (an op's own, inside C++): their profiler site
        py = collections.Counter()
        for (ph, kind), v in self.host.counts.items():
            if kind == "scalar":
                py[ph] += v
        inner = collections.Counter()
        for (ph, op), v in self.reads.items():
            inner[ph] += v
        for ph, v in inner.items():
            extra = v - py.get(ph, 0)
            if extra > 0:
                sites[f"{ph} | aten reads not from a Python call | -"] += extra
        sites = collections.Counter({k: v for k, v in sites.items() if v})
        comm = collections.Counter()
        for (ph, _), v in self.comm.items():
            comm[ph] += v
        gpu_reads = collections.Counter()
        for k, v in sites.items():
            if cpu_only(k) is None:
                gpu_reads[k.split(" | ")[0]] += v
        return {"launches_per_step": sum(self.launch.values()) / s,
                "gpu_host_reads_per_step": sum(gpu_reads.values()) / s,
                "gpu_host_reads_by_phase": {ph: gpu_reads.get(ph, 0) / s for ph in PHASES if gpu_reads.get(ph)},
                "launches_by_phase": {ph: self.launch.get(ph, 0) / s for ph in PHASES if self.launch.get(ph)},
                "host_reads_per_step": sum(reads.values()) / s,
                "host_reads_by_phase": {ph: reads.get(ph, 0) / s for ph in PHASES if reads.get(ph)},
                "host_reads_by_kind": per(_merge(self.reads) + collections.Counter(
                    {k: v for k, v in _merge(self.host.counts).items() if k != "scalar"})),
                "host_read_sites": per(sites),
                "collectives_by_phase": {ph: comm.get(ph, 0) / s for ph in PHASES if comm.get(ph)},
                "top_ops": [(f"{ph} {op}", v / s) for (ph, op), v in self.ops.most_common(40)],
                "complete": self.done}


# host reads that a GPU run does not make (the value is a host tensor there too, or the code path is the
# CPU's): (substring of "phase | kind | site", why)
CPU_ONLY = (("qatfactory/train/data.py", "the sample order is a host tensor on a GPU too"),
            ("scalar | qatfactory/train/methods/base.py", "float() of the loss already copied to the host"),
            ("adam | aten reads not from a Python call", "torch's fused AdamW on a CPU reads each step counter; "
                                                         "on CUDA the counters are device tensors"),
            ("qatfactory/formats/", "the CPU's format emulator; the CUDA kernels take the amax on the device"))


def cpu_only(site: str):
    """Why a host-read site is not one on a GPU (None: it is)."""
    for key, why in CPU_ONLY:
        if key in site:
            return why
    return None


def _merge(c: collections.Counter) -> collections.Counter:
    out = collections.Counter()
    for (_, k), v in c.items():
        out[k] += v
    return out


@contextlib.contextmanager
def instrumented_phases():
    """The trainer's phases wrapped in profiler ranges (and in the Python-side phase stack)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    import qatfactory.train.student as E
    from qatfactory.distill import teachers
    from qatfactory.nn import step_cache
    patches: list = []
    _wrap(E.StudentLM, "shifted", "forward", patches)
    _wrap(E, "lm_loss", "loss", patches)
    _wrap(teachers.HiddenStates, "forward", "teacher", patches)
    _wrap(DeepSpeedEngine, "forward", "ds_forward", patches)
    _wrap(DeepSpeedEngine, "backward", "ds_backward", patches)
    _wrap(DeepSpeedEngine, "step", "ds_step", patches)
    _wrap(step_cache, "weights_changed", "weights_changed", patches)
    _wrap_tensor_backward(patches)
    try:
        yield
    finally:
        _unpatch(patches)


@contextlib.contextmanager
def instrumented(counts: Counts, fused_adam: bool = True):
    """instrumented_phases, steps marked at each micro-batch draw, and (with ``fused_adam``) the GPU's
    optimizer type handed to DeepSpeed."""
    import deepspeed
    import torch

    import fused_adam_cpu
    import qatfactory.train.methods.base as E
    init = deepspeed.initialize
    rank_batch = E.rank_batch

    def initialize(*a, **kw):
        if fused_adam and isinstance(kw.get("optimizer"), torch.optim.AdamW):
            kw["optimizer"] = fused_adam_cpu.swap_in(kw["optimizer"])
        return init(*a, **kw)

    def draw(*a, **kw):
        counts.step_now()
        with phase("data"):
            return rank_batch(*a, **kw)
    deepspeed.initialize, E.rank_batch = initialize, draw
    try:
        with instrumented_phases(), counts.host, counts.prof:
            yield
    finally:
        deepspeed.initialize, E.rank_batch = init, rank_batch


def _wrap_tensor_backward(patches: list) -> None:
    import torch
    _wrap(torch.Tensor, "backward", "backward", patches)


# the GPU's weight-cache fill: one batched launch per row length instead of one per linear (first, so a
# variant's own overrides still win)
GPU_FILL = "train.weight_cache_batch=always"


def run_ours(name: str, over, args) -> dict:
    import step
    step.MODELS["thin16"] = THIN
    ns = argparse.Namespace(device="cpu", model="thin16", workdir=args.workdir, steps=args.total(), warmup=0,
                            batch=args.batch, seq=args.seq, chunk=args.chunk, profile_steps=0, op_table=None,
                            out=None)
    counts = Counts(args.skip, args.steps)
    t0 = time.time()
    with instrumented(counts, fused_adam=not args.torch_adamw):
        row = step.one(name, [GPU_FILL, *over], ns, tag=f"counts{int(t0 * 1000) % 100000}")
    return {"variant": name, **counts.result(), "run_s": time.time() - t0, "cpu_ms_per_step": row["ms_per_step"]}


def run_peer(args) -> dict:
    """step_peers' plain fp32-master loop on the thin shape: fp32 parameters, bf16 autocast, torch's
    fused AdamW (fused=True also runs on a CPU: one op, as one multi-tensor kernel on a GPU)."""
    import torch
    import torch.nn.functional as F

    import step_peers
    step_peers.SHAPES["thin16"] = THIN_SHAPE
    model = step_peers.build("thin16", torch.float32, torch.device("cpu"))
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randint(0, VOCAB, (args.batch, args.seq), generator=g) for _ in range(4)]
    counts = Counts(args.skip, args.steps)

    class Steps(list):
        def __getitem__(self, i):
            counts.step_now()
            return list.__getitem__(self, i)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-6, betas=(0.9, 0.95),
                            fused=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    patches: list = []
    from transformers import LlamaForCausalLM
    _wrap(LlamaForCausalLM, "forward", "forward", patches)
    fns = argparse.Namespace(cross_entropy=F.cross_entropy)
    _wrap(fns, "cross_entropy", "loss", patches)
    _wrap_tensor_backward(patches)
    times: list = []
    t0 = time.time()
    try:
        with counts.host, counts.prof:
            step_peers._loop(model, None, None, opt, Steps(data), autocast, False, args.total(), times, False, fns)
    finally:
        _unpatch(patches)
    return {"variant": PEER, **counts.result(), "run_s": time.time() - t0,
            "cpu_ms_per_step": sorted(times)[len(times) // 2]}


def table(rows) -> str:
    cols = [p for p in PHASES if any(r.get("launches_by_phase", {}).get(p) for r in rows)]
    L = ["| variant | launches/step | " + " | ".join(cols) + " | host reads/step (CPU) | of them also on a GPU "
         "| GPU reads by phase |", "|---|---:|" + "---:|" * len(cols) + "---:|---:|---|"]
    for r in rows:
        if "error" in r:
            L.append(f"| {r['variant']} | failed: {r['error'][:120]} |" + " |" * (len(cols) + 3))
            continue
        lp = r["launches_by_phase"]
        rd = ", ".join(f"{k} {v:.0f}" for k, v in r["gpu_host_reads_by_phase"].items()) or "-"
        L.append(f"| {r['variant']} | {r['launches_per_step']:.0f} | "
                 + " | ".join(f"{lp.get(p, 0):.0f}" for p in cols)
                 + f" | {r['host_reads_per_step']:.0f} | {r['gpu_host_reads_per_step']:.0f} | {rd} |")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="step.py variant names, '|'-separated (exact)")
    ap.add_argument("--levers", action="store_true", help="also step.py's lever rows of these variants")
    ap.add_argument("--no-peer", dest="peer", action="store_false")
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=31, help="loss chunk tokens (4 chunks of 4 x 31, as 4 x 2047 / 2048)")
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--torch-adamw", action="store_true",
                    help="leave the trainer's CPU optimizer (torch AdamW: DeepSpeed's FP16_UnfusedOptimizer)")
    ap.add_argument("--sites", type=int, default=12, help="host-read call sites listed per variant")
    ap.add_argument("--extra", nargs="*", default=[], help="more trainer overrides for every variant of ours")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    args.total = lambda: args.skip + 2 + args.steps
    import torch
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import step
    allv = step.variants(args.format, before=True)
    names = [n for n in args.variants.split("|") if n]
    if args.levers:
        # the stock-DeepSpeed before rows of these variants, then step.py's lever rows
        names = [x for n in names for x in ((n + step.BEFORE_DS, n) if n + step.BEFORE_DS in allv else (n,))]
        names += [n for n in LEVER_ROWS if n not in names]
    missing = [n for n in names if n not in allv]
    if missing:
        ap.error(f"not step.py variants: {missing}; known: {list(allv)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="qf-step-counts-") as td:
        args.workdir = td
        for n in names:
            try:
                rows.append(run_ours(n + (f" + {' '.join(args.extra)}" if args.extra else ""),
                                     allv[n] + list(args.extra), args))
            except Exception as e:   # a variant that fails is a row, the rest still run
                traceback.print_exc()
                rows.append({"variant": n, "error": f"{type(e).__name__}: {e}"})
            _print_row(rows[-1], args.sites)
        if args.peer:
            rows.append(run_peer(args))
            _print_row(rows[-1], args.sites)
    md = table(rows)
    print("\n" + md)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                         "torch": torch.__version__, "device": "cpu (counts only)",
                                         "shape": {"layers": LAYERS, "hidden": HIDDEN, "inter": INTER,
                                                   "vocab": VOCAB, "batch": args.batch, "seq": args.seq,
                                                   "chunk": args.chunk},
                                         "setting": {k: v for k, v in vars(args).items()
                                                     if k not in ("json", "total", "workdir")},
                                         "rows": rows, "table": md}, indent=1, default=str))
    return 0


def _print_row(r, n_sites: int) -> None:
    if "error" in r:
        print(f"{r['variant']}: FAILED {r['error']}", flush=True)
        return
    ph = ", ".join(f"{k} {v:.0f}" for k, v in r["launches_by_phase"].items())
    rd = ", ".join(f"{k} {v:.0f}" for k, v in r["host_reads_by_phase"].items())
    print(f"\n== {r['variant']}: {r['launches_per_step']:.0f} launches/step ({ph}); "
          f"{r['host_reads_per_step']:.0f} host reads/step ({rd}); collectives {r['collectives_by_phase']}",
          flush=True)
    for k, v in list(r["host_read_sites"].items())[:n_sites]:
        why = cpu_only(k)
        print(f"   {v:6.1f}  {k}" + (f"   [CPU only: {why}]" if why else ""))


if __name__ == "__main__":
    sys.exit(main())
