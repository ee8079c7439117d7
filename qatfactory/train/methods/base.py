"""The method seam: what a training method is to the one loop (train/loop.py), and what a run hands to the face.

The loop owns the run: distributed init, the run directory, DeepSpeed, the optimizer and LR schedule,
logging, evaluations, checkpoints, resume, the step levers and the summary. A :class:`Method` fills
in hooks, each with a default that is the distillation recipe (qad):

    validate(cfg)                 once, when the config is composed
    preflight(cfg, world)         once the process group exists, before the run dir
    build(ctx)                    ctx.model / tokenizer / source_dir   (default: runtime.build_model)
    data(ctx)                     ctx.train_data / eval_data           (default: data.load_data)
    prepare(ctx)                  the student: quantize, calibrate (skipped on resume)
    module(ctx), parameters(...)  what DeepSpeed wraps, and what trains
    accumulation(ctx)             micro-batches per optimizer step, optimizer steps per loop step
    begin(ctx, state)             after deepspeed.initialize and a resume's load
    before_step / micro_batches / train_step / after_step / record      one loop step
    evaluate(ctx)                 one held-out evaluation (default: KL / CE / top-1 to the teacher)
    end(ctx), close(ctx)          after the last step; close always, even on an error
    state()                       what the method adds to a checkpoint (read back in begin)
    export(ctx)                   rank 0, full weights: the Student the face ships

A method reaches the loop's services only through the :class:`Context` it is lent (``ctx.engine``,
``ctx.forward``, ``ctx.evaluate``, ``ctx.reset_optimizer``, ``ctx.teacher_outputs``, ``ctx.levers``).

A run returns a :class:`Student`: the trained module, the student directory, and, when the run
asks for an export, the converted model and where it goes. The face (``qatfactory train``,
``python -m qatfactory.train``, the demo) ships it with ``qatfactory.faces.ship.ship``: nothing under
train/ imports an exporter.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ... import _fsutil
from ... import quantize as Q
from .. import runtime as R
from ..data import Order, load_data, rank_batch
from ..seqpar import shard_batch
from ..student import StudentLM, eval_count, evaluate

NO_QUANT = ("none",)     # quant.weight_format=none: train the plain model (the bf16 SFT baseline)


def _calib_batch(b, dev) -> Dict[str, torch.Tensor]:
    """A calibration forward's kwargs: packed documents (position ids) attend as in training."""
    if "position_ids" in b:
        return {"input_ids": b["input_ids"].to(dev), "position_ids": b["position_ids"].to(dev), "use_cache": False}
    return {"input_ids": b["input_ids"].to(dev), "attention_mask": b["attn"].to(dev)}


def quantized(cfg) -> bool:
    return cfg.quant.weight_format not in NO_QUANT


@dataclass(frozen=True)
class Needs:
    """What a method needs from the run.

    teacher: the teacher kinds it trains from (``("live", "cached")``: method.teacher says which;
    empty: it trains without one; method.eval_teacher may still load one to report KL / top-1).
    rollouts: it samples from the student (RL). native_base: model.path is a native 4-bit
    checkpoint whose codes stay frozen. quantized: it refuses format=bf16. trains: False for a
    method that only calibrates and evaluates."""

    teacher: Tuple[str, ...] = ()
    rollouts: bool = False
    native_base: bool = False
    quantized: bool = False
    trains: bool = True


@dataclass
class Student:
    """What a run hands to the face. ``converted`` (a formats.ConvertedModel) is there on rank 0
    when the run asks for an export; ``ship`` then says where to (engine, flavour, out, verify).
    ``native_base`` / ``training_logits``: extra rows of the parity gate (scale adapters: the
    export's code plane is the base's, its logits are the training forward's)."""

    model: Any = None
    student_dir: Optional[str] = None
    converted: Any = None
    ship: Optional[Dict[str, Any]] = None
    native_base: Optional[str] = None
    training_logits: Optional[Callable[[List[int]], Tuple[torch.Tensor, str]]] = None
    # a LoRA adapter folder the run ships beside the export: {"dir", "rank", "alpha", "modules":
    # {name: (lora_A, lora_B)} as trained, "linears"}; the face gates the folder against it
    adapter: Optional[Dict[str, Any]] = None

    def request(self, cfg, run_dir: Path, export_dir: Optional[str] = None) -> "Student":
        """Fill ``ship`` from cfg.export (export_dir: the target rundir.prepare checked before training)."""
        if cfg.export.enabled and self.converted is not None:
            out = Path(export_dir or cfg.export.out_dir or (Path(run_dir) / f"export-{cfg.export.engine}"))
            self.ship = {"engine": cfg.export.engine, "flavour": cfg.export.flavour, "out": str(out),
                         "verify": bool(cfg.export.verify)}
        return self


@dataclass
class Context:
    """What the loop lends a method for one run. Fields are read (build / data / prepare fill the
    model and data ones); the services are the loop's: ``forward(batch, teacher_out)`` runs the
    DeepSpeed-wrapped student (and so the method's :meth:`Method.loss`) on one micro-batch;
    ``evaluate()`` records a held-out evaluation at the current step; ``reset_optimizer()`` re-reads
    the weights into the optimizer and clears its state; ``teacher_outputs(split, batch)`` is a
    context manager giving the teacher's outputs (None without a teacher); ``call(*args, **kw)``
    runs the wrapped module with arguments of the method's own module (Method.module)."""

    cfg: Any
    rank: int
    world: int
    device: torch.device
    run_dir: Path
    model: Any = None                 # the Hugging Face model; Method.prepare may replace it
    tokenizer: Any = None
    train_data: Any = None
    eval_data: Any = None
    source_dir: Optional[str] = None
    resumed: bool = False
    eval_only: bool = False
    calib: List[Dict[str, torch.Tensor]] = field(default_factory=list)
    step: int = 0                     # loop steps done
    position: int = 0                 # samples of the training order consumed (default micro_batches)
    order: Any = None                 # data.Order of the training samples
    history: List[Dict[str, Any]] = field(default_factory=list)
    engine: Any = None                # the DeepSpeed engine (its module: Method.module's)
    teacher: Any = None               # student.Teacher or None
    levers: Any = None                # the step levers of this run
    forward: Optional[Callable] = None
    call: Optional[Callable] = None
    evaluate: Optional[Callable] = None
    reset_optimizer: Optional[Callable] = None
    teacher_outputs: Optional[Callable] = None
    # Ulysses sequence parallelism (train/seqpar.py): ranks [g sp, (g + 1) sp) share one micro-batch, each
    # holding a contiguous shard of its sequence; the data-parallel degree is world / sp
    sp: int = 1
    sp_rank: int = 0

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def dp_world(self) -> int:
        return self.world // self.sp

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[qatfactory] {msg}", flush=True)


class Method:
    """One training method. Subclass, set ``name`` (and what differs), register it:
    ``qatfactory.train.methods.register(MyMethod)``. A module outside the package that does so is
    imported by ``plugins=[my.module]``; ``recipe`` (what recipes/method/<name>.yaml would hold,
    ``@package _global_``) then makes ``method=<name>`` selectable like a recipe file."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    needs: ClassVar[Needs] = Needs()
    # the schema of this method's own options: a dataclass held at cfg.method.<options_key>
    # (built-ins: method.rl, method.scale) or, for a plugin, read from the free dict method.options
    options: ClassVar[Optional[type]] = None
    options_key: ClassVar[Optional[str]] = None
    recipe: ClassVar[Optional[Dict[str, Any]]] = None
    # None: the method runs the quant_start schedule (methods/quant_start.py); else why it does not
    quant_start_refusal: ClassVar[Optional[str]] = "method={name} does not run the quant_start schedule"
    # the run always hands its result to export() (an adapter, a scale file), not only when it saves a
    # student or exports
    always_exports: ClassVar[bool] = False
    # None: ZeRO-3 runs; else why this method refuses it
    zero3_refusal: ClassVar[Optional[str]] = None
    # None: the method keeps k-quant scales between searches (quant.kquant_refresh_every); else why not
    kquant_refresh_refusal: ClassVar[Optional[str]] = None
    # the start / end rows of the printed summary, and the curves of plots/ (group -> keys)
    summary_keys: ClassVar[Tuple[str, ...]] = ("kl", "ce", "ppl", "top1")
    plots: ClassVar[Dict[str, Tuple[str, ...]]] = {"train": ("loss", "lr", "tokens_per_s"),
                                                   "eval": ("eval/kl", "eval/ce", "eval/top1")}

    # ------------------------------------------------------------------ config
    def validate(self, cfg) -> None:
        """Raise ValueError naming the field when cfg does not fit this method."""
        m = cfg.method
        if self.needs.teacher and not m.loss.needs_teacher:
            raise ValueError(f"method.name={m.name!r} with method.loss.kind={m.loss.kind!r}; {m.name} distills from a "
                             f"teacher: use forward_kl / reverse_kl / jsd, or method=qat for CE")
        if self.needs.teacher and m.teacher not in self.needs.teacher:
            raise ValueError(f"method.teacher={m.teacher!r} with method={m.name}; allowed: {list(self.needs.teacher)}")
        if self.needs.quantized and not quantized(cfg):
            raise ValueError(f"method={m.name} trains a quantized student; format=bf16 quantizes nothing")
        if cfg.export.enabled and not quantized(cfg) and not self.needs.native_base:
            raise ValueError("export.enabled with format=bf16: nothing is quantized; pick a format recipe")
        if m.options and (self.options is None or self.options_key):
            raise ValueError(f"method.options={dict(m.options)!r}: method={m.name} takes no free options"
                             + (f" (its own are method.{self.options_key}.*)" if self.options_key else ""))
        if self.options is not None and not self.options_key:
            self.opts(cfg)           # the plugin's schema: an unknown key or a wrong type is named here
        if self.zero3_refusal and cfg.train.zero_stage == 3:
            raise ValueError(f"method={m.name}: train.zero_stage=3 is not supported ({self.zero3_refusal}); "
                             f"allowed: 0, 1, 2")
        if self.kquant_refresh_refusal and cfg.quant.kquant_refresh_every != 1:
            raise ValueError(f"quant.kquant_refresh_every={cfg.quant.kquant_refresh_every}: method={m.name} "
                             f"{self.kquant_refresh_refusal}; allowed: 1 for this method")

    def preflight(self, cfg, world: int) -> None:
        """Once the process group exists, before the run directory is made: raise (ValueError, or an
        exitcodes error for a bad input file) for what would fail later, e.g. cfg not fitting ``world``."""

    def opts(self, cfg):
        """This method's typed options (``options``), from cfg.method.<options_key> or method.options."""
        if self.options is None:
            return None
        if self.options_key:
            return getattr(cfg.method, self.options_key)
        try:
            node = OmegaConf.merge(OmegaConf.structured(self.options), OmegaConf.create(dict(cfg.method.options or {})))
            return OmegaConf.to_object(node)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None)
            raise ValueError(f"method.options (method={cfg.method.name}): {str(e).splitlines()[0]}"
                             + (f" (field method.options.{key})" if key else "")) from None

    def teacher(self, cfg) -> Optional[str]:
        """Which teacher the loop loads ("live" | "cached" | None): the one the loss trains from, or
        one only to report KL / top-1 (method.eval_teacher)."""
        m = cfg.method
        return m.teacher if (m.loss.needs_teacher or m.eval_teacher) else None

    # ------------------------------------------------------------------ the student
    def build(self, ctx: Context) -> None:
        """ctx.model, ctx.tokenizer, ctx.source_dir: the model cfg.model names, in model.dtype (on
        the GPU when the run has one: calibration and the teacher copy then run there)."""
        ctx.model, ctx.tokenizer, ctx.source_dir = R.build_model(ctx.cfg, ctx.device)
        if ctx.device.type == "cuda":
            ctx.model.to(ctx.device)

    def data(self, ctx: Context) -> None:
        """ctx.train_data, ctx.eval_data (data.load_data) and the seeded order of the training samples."""
        vocab = ctx.model.get_output_embeddings().weight.shape[0]
        ctx.train_data, ctx.eval_data = load_data(ctx.cfg.data, ctx.tokenizer, vocab, ctx.cfg.train.seed)
        ctx.order = Order(len(ctx.train_data), ctx.cfg.train.seed)

    def prepare(self, ctx: Context) -> None:
        """Turn ctx.model into the student: quantize.prepare for the format, the calibration
        batches (ctx.calib), and calibration unless the run resumes from a checkpoint."""
        cfg = ctx.cfg
        if not quantized(cfg):
            return
        ctx.model = Q.prepare(ctx.model, cfg.quant) or ctx.model
        if ctx.rank == 0:
            tot = Q.coverage(ctx.model).totals
            print(f"[qatfactory] quantized {100 * tot['asked_fraction']:.1f}% of the {tot['asked_params']:,} "
                  f"Linear-like parameters asked for ({tot['bits_per_quantized_param']:.3f} bits each)"
                  + ("" if tot["asked_fraction"] >= 1.0 else f"; kept as they are: {tot['not_quantized'][:4]}"),
                  flush=True)
        s, dev = ctx.train_data, ctx.device
        n = min(cfg.method.calib_samples, len(s))
        ctx.calib = [_calib_batch(s.select([i]), dev) for i in range(n)]
        if cfg.method.calibrate and not ctx.resumed:
            Q.calibrate(ctx.model, ctx.calib, cfg.quant.calib_method)

    def module(self, ctx: Context):
        """The module DeepSpeed wraps; its forward gives a micro-batch's loss (default: StudentLM,
        whose forward is :meth:`loss`)."""
        return StudentLM(ctx.model, ctx.cfg.method.loss, self)

    def parameters(self, ctx: Context, module) -> List[torch.nn.Parameter]:
        """What the optimizer steps."""
        return [p for p in module.parameters() if p.requires_grad]

    def optimizer(self, ctx: Context, params: List[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The torch optimizer (train.optimizer=adamw_torch; adamw_fused is DeepSpeed's own)."""
        t = ctx.cfg.train
        return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)

    def accumulation(self, ctx: Context) -> Tuple[int, int]:
        """(micro-batches per optimizer step, optimizer steps per loop step)."""
        return int(ctx.cfg.train.grad_accum), 1

    def tokens(self, ctx: Context) -> int:
        """Training tokens read so far (the summary's ``tokens``)."""
        return ctx.step * self.tokens_per_step(ctx)

    def tokens_per_step(self, ctx: Context) -> int:
        """Training tokens one loop step reads (all ranks)."""
        t = ctx.cfg.train
        return t.micro_batch * ctx.dp_world * t.grad_accum * ctx.cfg.data.seq_len

    # ------------------------------------------------------------------ one step
    def micro_batches(self, ctx: Context) -> Iterator[Dict[str, torch.Tensor]]:
        """This rank's micro-batches of one step: train.grad_accum slices of the seeded order."""
        t = ctx.cfg.train
        for _ in range(t.grad_accum):
            b = rank_batch(ctx.train_data, ctx.order, ctx.position, t.micro_batch, ctx.dp_rank, ctx.dp_world)
            ctx.position += t.micro_batch * ctx.dp_world
            yield b if ctx.sp == 1 else shard_batch(b, ctx.sp_rank, ctx.sp)

    def train_step(self, ctx: Context, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of one micro-batch (the loop calls backward and the optimizer step). A teacher loaded
        only to report KL (method.eval_teacher) is not run here when the loss is this class's own, which
        reads no teacher then (a forward of the whole teacher per step for nothing)."""
        if not ctx.cfg.method.loss.needs_teacher and type(self).loss is Method.loss:
            return ctx.forward(batch, None)
        with ctx.teacher_outputs("train", batch) as t:
            return ctx.forward(batch, t)

    def loss(self, student, input_ids, attn, mask, teacher) -> torch.Tensor:
        """Runs inside the DeepSpeed-wrapped module's forward (so ZeRO-3 gathers what it reads):
        the chunked loss of method.loss over the next-token targets (the teacher only when the
        loss reads one)."""
        return student.default_loss(input_ids, attn, mask, teacher)

    def after_step(self, ctx: Context) -> None:
        """After the step's last optimizer step, before its record (ctx.step is not yet advanced)."""

    def record(self, ctx: Context, loss_sum: torch.Tensor, micro: int) -> Dict[str, Any]:
        """The step's logged values besides step / lr / timings: the mean loss over this step's
        ``micro`` micro-batches and the ranks (``loss_sum``: this rank's sum, float64 on the device),
        and ``kl`` when the loss is exactly the mean KL(teacher || student)."""
        if ctx.world > 1:
            torch.distributed.all_reduce(loss_sum)
            loss_sum = loss_sum / ctx.world
        loss_v = float(loss_sum.cpu()) / micro
        rec: Dict[str, Any] = {"loss": loss_v}
        lc = ctx.cfg.method.loss
        if lc.kind == "forward_kl" and lc.ce_weight == 0 and lc.kd_weight == 1 and lc.temperature == 1 \
                and type(self).loss is Method.loss:
            rec["kl"] = loss_v
        return rec

    def progress(self, ctx: Context, rec: Dict[str, Any]) -> Dict[str, Any]:
        """What the progress bar shows after a step."""
        post: Dict[str, Any] = {"loss": rec["loss"]}
        if "kl" in rec:
            post["kl"] = rec["kl"]
        elif ctx.history and "eval/kl" in ctx.history[-1]:
            post["eval_kl"] = ctx.history[-1]["eval/kl"]
        post.update(lr=rec["lr"], tok_s=int(rec.get("tokens_per_s", 0)), mem=f"{rec.get('mem_gb', 0.0):.1f}G")
        return post

    def evaluate(self, ctx: Context) -> Optional[Dict[str, Any]]:
        """One held-out evaluation (None: this run does not evaluate now): KL to the teacher, CE,
        perplexity and top-1 agreement over train.eval_samples held-out samples."""
        t = ctx.cfg.train
        return evaluate(ctx.engine, ctx.eval_data, ctx.teacher, eval_count(ctx.cfg, ctx.eval_data), t.micro_batch,
                        ctx.rank, ctx.world, ctx.device, sp=(ctx.sp_rank, ctx.sp))

    # ------------------------------------------------------------------ hooks around the loop (no-ops)
    def lr_restart(self, cfg) -> Tuple[int, float]:
        """(optimizer step, LR factor): the schedule restarts there (0: never)."""
        return 0, 1.0

    def begin(self, ctx: Context, state: Dict[str, Any]) -> None:
        """After deepspeed.initialize (and a resume's load; ``state`` is its trainer_state)."""

    def before_step(self, ctx: Context) -> None:
        """At the start of each optimizer step."""

    def end(self, ctx: Context) -> bool:
        """After the last step; True when the model changed since the last evaluation."""
        return False

    def close(self, ctx: Context) -> None:
        """When the run leaves the loop, normally or not (undo what begin entered)."""

    def summary_entries(self, ctx: Context) -> Dict[str, Any]:
        """Entries the method adds to summary.json (after export)."""
        return {}

    def state(self) -> Dict[str, Any]:
        """Extra entries of trainer_state.json (read back by :meth:`begin` on resume)."""
        return {}

    def eval_tags(self) -> Dict[str, Any]:
        """Extra entries of each evaluation record."""
        return {}

    # ------------------------------------------------------------------ the end
    def export(self, ctx: Context) -> Student:
        """Rank 0, full weights (gathered under ZeRO-3): save the student, and convert it when the
        run asks for an export."""
        cfg, lm = ctx.cfg, ctx.model
        sdir = Path(ctx.run_dir) / "student"
        if quantized(cfg):
            Q.save_student(lm, str(sdir), source_dir=ctx.source_dir)
        elif cfg.train.save_student:
            with _fsutil.atomic_dir(sdir, replace=True, kinds=("student",), what="save_student") as tmp:
                lm.save_pretrained(str(tmp))   # a plain HF model
                (tmp / _fsutil.STUDENT_RECORD).write_text(json.dumps({"quant_config": None, "plain": True}))
        st = Student(model=lm, student_dir=str(sdir))
        if cfg.export.enabled:
            st.converted = Q.convert(lm)
            if ctx.source_dir and st.converted.source_dir is None:
                st.converted.source_dir = ctx.source_dir
        return st
