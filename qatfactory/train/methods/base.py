"""The method seam: what a training method is to the loop, and what a run hands to the face.

A :class:`Method` says what it needs, how it prepares the student, its loss and what it exports;
the loop (train/engine.py) owns everything else: distributed init, DeepSpeed, the data order, the
optimizer and LR schedule, logging, evaluation, checkpoints and resume. A method reaches those only
through the :class:`Context` the loop lends it (``ctx.forward``, ``ctx.evaluate``,
``ctx.reset_optimizer``). A method with a loop of its own (RL rollouts, scale adapters on a native
4-bit base) sets :attr:`Method.own_loop`; the loop then hands the whole run to it.

A run returns a :class:`Student`: the trained module, the student directory, and, when the run
asks for an export, the converted model and where it goes. The face (``qatfactory train``,
``python -m qatfactory.train``, the demo) ships it with ``qatfactory.ship.ship``: nothing under
train/ imports an exporter.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ... import _fsutil
from ... import quantize as Q
from ...distill.losses import lm_loss

NO_QUANT = ("none",)     # quant.weight_format=none: train the plain model (the bf16 SFT baseline)


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
    """What the loop lends a method for one run. Fields are read; the services are the loop's:
    ``forward(batch, teacher_out)`` runs the DeepSpeed-wrapped student (and so the method's
    :meth:`Method.loss`) on one micro-batch; ``evaluate()`` records a held-out evaluation at the
    current step; ``reset_optimizer()`` re-reads the weights into the optimizer and clears its
    state; ``teacher_outputs(split, batch)`` is a context manager giving the teacher's outputs
    (None without a teacher)."""

    cfg: Any
    rank: int
    world: int
    device: torch.device
    run_dir: Path
    model: Any = None                 # the Hugging Face model; Method.prepare may replace it
    train_data: Any = None
    eval_data: Any = None
    source_dir: Optional[str] = None
    resumed: bool = False
    calib: List[Dict[str, torch.Tensor]] = field(default_factory=list)
    step: int = 0
    history: List[Dict[str, Any]] = field(default_factory=list)
    forward: Optional[Callable] = None
    evaluate: Optional[Callable] = None
    reset_optimizer: Optional[Callable] = None
    teacher_outputs: Optional[Callable] = None

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
    # a loop of its own: fn(cfg, eval_only) -> summary (it still ends by returning a Student)
    own_loop: ClassVar[Optional[Callable]] = None

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
        ctx.calib = [{"input_ids": b["input_ids"].to(dev), "attention_mask": b["attn"].to(dev)}
                     for b in (s.select([i]) for i in range(n))]
        if cfg.method.calibrate and not ctx.resumed:
            Q.calibrate(ctx.model, ctx.calib, cfg.quant.calib_method)

    # ------------------------------------------------------------------ one step
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
        h, w, labels, m, t = student.shifted(input_ids, attn, mask, teacher)
        return lm_loss(h, w, labels, m, t if student.loss_cfg.needs_teacher else None, student.loss_cfg)

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
