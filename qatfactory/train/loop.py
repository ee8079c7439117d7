"""The one training loop under DeepSpeed: :func:`run`, from a RunConfig to a run dir and a Student.

    run_dir/config.yaml        the resolved config
    run_dir/metrics.jsonl      one line per logged step and per evaluation (tb/ too when installed)
    run_dir/checkpoints/       step-N directories (see checkpoint.py), last keep_last kept
    run_dir/teacher_cache/     cached-teacher runs: top-k log-probabilities (train/ and eval/)
    run_dir/plots/*.png        curves; run_dir/summary.json + printed summary at the end
    run_dir/student/           quantize.save_student (train.save_student), input of `qatfactory export`

Every method runs here (train/methods/, picked by method.name); what differs between them is hooks
(methods/base.py): a QAD step is train.grad_accum micro-batches of the data order; a GRPO step is a
rollout, its rewards and advantages, then several optimizer steps over the buffered completions; a
scale-adapter step ends by pulling the scale bytes back into their trust region. The loop owns the
rest, the same for all: distributed init, the run directory, DeepSpeed, the optimizer and LR schedule,
the step levers, logging, evaluation, checkpoints and resume, the summary and plots. The run returns
the student (``summary["student"]``, a methods.Student); the face ships it (``qatfactory.faces.ship``).

Launch: ``qatfactory train k=v ...`` / ``python -m qatfactory.train k=v ...`` (one process; the env
vars DeepSpeed expects are set here) or ``deepspeed --num_gpus N -m qatfactory.train k=v ...``.

Order of work: distributed init -> run dir -> build, data (Method.build / data) -> teacher copy ->
Method.prepare (quantize, calibrate) -> step levers -> teacher -> deepspeed.initialize -> [resume] ->
Method.begin -> eval at start -> steps (eval, save) -> Method.end, final eval, checkpoint -> summary,
plots -> Method.export. A method that does not train (ptq) stops after the first evaluation.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import time
from typing import Any, Dict, Optional

import torch

from .. import _fsutil
from ..exitcodes import UsageError
from . import checkpoint as ckpt
from . import levers, rundir, runlock
from . import runtime as R
from .config import NO_QUANT, RunConfig, is_validated, to_dict, validate
from .methods import Context, Method, Student, get_method
from .runlog import RunLogger, memory_gb, plot_curves, summary_text
from .stream_export import cpu_student
from .student import load_teacher


def run(cfg: RunConfig, eval_only: bool = False) -> Dict[str, Any]:
    """Train (or only calibrate and evaluate, for ptq) as cfg says; returns the summary dict, with
    ``summary["student"]`` (methods.Student: what the face ships) and ``summary["engine"]``.
    ``eval_only``: restore cfg.resume and evaluate it, no training. ``cfg`` is validated here unless
    the face composed it (compose validates once)."""
    if not is_validated(cfg):
        cfg = validate(cfg)
    method = get_method(cfg.method.name)
    # the step levers of the run (train/levers.py): switched from cfg, undone when the run ends
    lv = levers.Levers(cfg, training=method.needs.trains and not eval_only)
    with runlock.held(), lv:   # the run directory stays locked to this process
        return _run(cfg, method, eval_only, lv)


def _run(cfg: RunConfig, method: Method, eval_only: bool, lv: levers.Levers) -> Dict[str, Any]:
    import deepspeed  # noqa: PLC0415 (optional: deepspeed)
    t, m = cfg.train, cfg.method
    device = R.resolve_device(t.device)
    R.init_distributed(device)
    rank, world = R.rank_world()
    if world % t.sequence_parallel:
        raise UsageError(f"train.sequence_parallel={t.sequence_parallel} with {world} ranks; allowed: a divisor of "
                         f"the number of ranks")
    method.preflight(cfg, world)
    dev = R.local_device(device)
    R.seed_all(t.seed)
    # which directory, whether it may be written, whether a resume is the same run: all checked
    # before any work (rundir.py); rank 0 writes the run record and config.yaml
    run_dir, resume_from, decision = rundir.prepare(cfg, rank, world, eval_only)
    t0 = time.time()

    # -- the student and its data
    ctx = Context(cfg=cfg, rank=rank, world=world, device=dev, run_dir=run_dir, resumed=resume_from is not None,
                  eval_only=eval_only, levers=lv)
    method.build(ctx)
    method.data(ctx)
    # the teacher the method trains from, or one loaded only to report KL and top-1 agreement
    tkind = method.teacher(cfg)
    teacher_init = copy.deepcopy(ctx.model) if (tkind and not m.teacher_path) else None
    method.prepare(ctx)
    model = ctx.model
    quantized = cfg.quant.weight_format not in NO_QUANT
    lv.install(model)                 # before DeepSpeed wraps it (lean_act: less activation memory, same bits)
    if t.grad_ckpt:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = model.get_output_embeddings().weight.shape[0]
    ctx.teacher = load_teacher(cfg, tkind, teacher_init, ctx.train_data, ctx.eval_data, run_dir, rank, device,
                               dev, vocab, eval_only)
    teacher_init = None
    sp_group = None
    if t.sequence_parallel > 1:
        # after calibration and the teacher cache's precompute, which run whole sequences on every rank
        from . import seqpar  # noqa: PLC0415 (deepspeed's sequence parallelism, only when asked)
        sp_group, ctx.sp_rank = seqpar.enable(model, t.sequence_parallel, t.micro_batch)
        ctx.sp = t.sequence_parallel
        ctx.say(f"sequence parallel (Ulysses): {ctx.sp} ranks per sequence, {cfg.data.seq_len // ctx.sp} tokens each, "
                f"data-parallel degree {ctx.dp_world}")

    # -- DeepSpeed
    module = method.module(ctx)
    if sp_group is not None:
        module.seq_parallel = (sp_group, ctx.sp)
    if t.zero_stage == 3:
        hw = module.head_param() if hasattr(module, "head_param") else None
        if hw is not None:
            deepspeed.zero.register_external_parameter(module, hw)
        if quantized:
            from .. import quantize as Q  # noqa: PLC0415 (only ZeRO-3 registers the fused groups' members)
            # fused q/k/v (gate/up) share one amax computed from all members' weights
            Q.register_zero3_external_params(model)
    train_now = method.needs.trains and not eval_only
    params = method.parameters(ctx, module)
    if train_now and not params:
        raise ValueError(f"method={m.name}: no trainable parameters after quantize.prepare")
    gas, updates_per_step = method.accumulation(ctx)
    dcfg = R.ds_config(cfg, device, train_now, grad_accum=gas)
    kw: Dict[str, Any] = {}
    if train_now:
        kw["model_parameters"] = params
        if "optimizer" not in dcfg:
            kw["optimizer"] = method.optimizer(ctx, params)
        sched = R.lr_lambda(t, method.lr_restart(cfg), total=t.max_steps * updates_per_step)
        kw["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, sched)
    engine, *_ = deepspeed.initialize(model=module, config=dcfg, **kw)
    ctx.engine = engine
    # DeepSpeed may have cast / moved / partitioned the weights; then the lean step and low-bit batching
    lv.attach(engine, world)

    def reset_optimizer():
        R.reset_optimizer(engine)
        lv.weights_changed()

    if train_now and t.fresh_adam and R.optimizer_stepped(engine):
        reset_optimizer()             # the first update is AdamW's step 1 (config.py: fresh_adam)

    logger_start = 0
    st: Dict[str, Any] = {}
    if resume_from is not None:
        st = ckpt.load(engine, resume_from, rank)
        lv.weights_changed()
        ctx.step, ctx.position, ctx.history = st["step"], st["position"], st.get("eval_history", [])
        logger_start = ctx.step
    history = ctx.history
    # an eval of a checkpoint leaves the run's own logs alone
    log = RunLogger(run_dir, rank == 0 and not eval_only, t.tensorboard, t.progress,
                    t.max_steps if train_now else 0, logger_start, report_to=t.report_to, config=to_dict(cfg))
    if decision.get("restart"):
        log.truncate_after(-1)           # the same run starting over: its old records are redone
    if resume_from is not None:
        log.truncate_after(ctx.step)
        ctx.say(f"resumed from {resume_from} at step {ctx.step}")

    def do_eval():
        r = method.evaluate(ctx)
        if r is None:
            return None
        r["step"] = ctx.step
        r.update(method.eval_tags())
        history.append(r)
        log.log(r)
        return r

    def call(*args, **kw):
        lv.forward()
        return engine(*args, **kw)

    def forward(b, tout):
        # packed documents (position ids); a sequence-parallel shard (its targets, taken before the cut)
        kw = {k: b[k].to(dev) for k in ("position_ids", "targets", "target_mask") if k in b}
        return call(b["input_ids"].to(dev), b["attn"].to(dev), b["mask"].to(dev), tout, **kw)

    def teacher_outputs(split, b):
        return ctx.teacher.batch(split, b, dev) if ctx.teacher is not None else contextlib.nullcontext()

    ctx.forward, ctx.call, ctx.evaluate, ctx.teacher_outputs = forward, call, do_eval, teacher_outputs
    ctx.reset_optimizer = reset_optimizer

    def state():
        d = {"step": ctx.step, "position": ctx.position, "eval_history": history, "config": to_dict(cfg),
             "world_size": world}
        d.update(method.state())
        return d

    try:
        method.begin(ctx, st)
        if resume_from is None or eval_only:
            do_eval()
        while train_now and ctx.step < t.max_steps:
            method.before_step(ctx)
            ts = time.time()
            loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
            micro = 0
            lr_now = float(engine.get_lr()[0])
            # quant.kquant_refresh_every > 1: the k-quant scale search runs on steps 0, K, 2K, ... only;
            # evaluations and exports (outside this block) always run it (nn/kquant_refresh.py)
            with lv.step(ctx.step):
                for b in method.micro_batches(ctx):
                    loss = method.train_step(ctx, b)
                    # the chunked loss took its gradients in forward: the teacher (and its gathered
                    # lm_head under ZeRO-3) is no longer needed for backward
                    engine.backward(loss)
                    # the weights change only at the accumulation boundary: the other micro-batches reuse the
                    # step's fake-quantized weights (nn/weight_cache.py; torch optimizers also signal it)
                    boundary = engine.is_gradient_accumulation_boundary()
                    engine.step()
                    if boundary:
                        lv.weights_changed()
                    loss_sum += loss.detach().double()      # stays on the device: one host sync per step
                    micro += 1
            method.after_step(ctx)
            rec: Dict[str, Any] = {"step": ctx.step + 1, "lr": lr_now}
            rec.update(method.record(ctx, loss_sum, max(micro, 1)))
            ctx.step += 1
            step = ctx.step
            dt = time.time() - ts
            rec.update(step_ms=dt * 1000.0, tokens_per_s=method.tokens_per_step(ctx) / max(dt, 1e-9),
                       mem_gb=memory_gb())
            if step % t.log_every == 0 or step == t.max_steps:
                log.log(rec)
            log.progress(1, **method.progress(ctx, rec))
            if t.eval_every and step % t.eval_every == 0 and step != t.max_steps:
                do_eval()
            if t.save_every and step % t.save_every == 0 and step != t.max_steps:
                ckpt.save(engine, run_dir, step, state(), t.keep_last, rank)
        step = ctx.step
        if train_now:
            changed = method.end(ctx)
            if changed or not history or history[-1]["step"] != step:
                do_eval()
            if t.save_final:
                ckpt.save(engine, run_dir, step, state(), t.keep_last, rank)
    finally:
        method.close(ctx)
    log.close()

    summary = {"run_dir": str(run_dir), "method": m.name, "format": cfg.quant.name or cfg.quant.weight_format,
               "steps": step, "tokens": method.tokens(ctx), "time_s": time.time() - t0, "world_size": world,
               "eval_first": history[0] if history else None, "eval_last": history[-1] if history else None,
               "eval_history": history}
    handed = Student(model=ctx.model)
    if not eval_only:
        # ZeRO-3: the last forward can leave prefetched parameters in flight; release them all
        # before the hand-over gathers the full weights (GatheredParameters refuses in-flight ones)
        engine.empty_partition_cache()
        handed = _hand_over(ctx, method, module, decision.get("export_dir"))
        if handed.student_dir:
            summary["student_dir"] = handed.student_dir
        summary.update(method.summary_entries(ctx))
    if rank == 0:
        name = f"eval-step-{step:06d}.json" if eval_only else "summary.json"
        run_dir.mkdir(parents=True, exist_ok=True)
        _fsutil.write_text_atomic(run_dir / name, json.dumps(summary, indent=1, default=str))
        if t.plots and not eval_only:
            plot_curves(run_dir, method.plots)
        print(summary_text(summary, method.summary_keys), flush=True)
    summary["student"] = handed
    summary["engine"] = engine
    return summary


def _hand_over(ctx: Context, method: Method, module, export_dir: Optional[str]) -> Student:
    """Method.export on rank 0 with the full weights (every rank joins the ZeRO-3 gather first):
    the student directory, and the converted model when the run asks for an export (the face
    ships it). A method that always writes what it trained (an adapter, a scale file) exports every
    time; the others only when the run saves a student or exports."""
    cfg = ctx.cfg
    out = Student(model=ctx.model)
    if not (cfg.train.save_student or cfg.export.enabled or method.always_exports):
        return out
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        # ZeRO-3: gathered one layer at a time into a CPU copy on rank 0, never the whole model on a
        # GPU (stream_export.py); every rank joins each gather
        lm, gathered = cpu_student(module.lm, ctx.rank)
        if ctx.rank == 0:
            out = method.export(dataclasses.replace(ctx, model=lm)).request(cfg, ctx.run_dir, export_dir)
            out.gather = gathered
        R.barrier()
        return out
    if ctx.rank == 0:
        out = method.export(ctx).request(cfg, ctx.run_dir, export_dir)
    R.barrier()
    return out
