"""QAT and QAD inside Hugging Face ``Trainer`` and TRL's trainers: your TrainingArguments, data collator,
DeepSpeed config and trackers; our fake quantization, frozen teacher, chunked losses and gated export.

    from qatfactory.integrations.transformers import QADTrainer
    trainer = QADTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, data_collator=collator,
                         format="nvfp4_w4a16", ship="vllm")
    trainer.train()          # at the end: export-vllm/ under output_dir, verified by the parity gate
    trainer.shipped.gate["verdict"]

:class:`QADTrainer` distills from a frozen teacher (default: a copy of the model before it is quantized, as
``qatfactory train method=qad``), :class:`QATTrainer` trains on the labels (``method=qat``). For TRL or any
other Trainer subclass, ``quantized(SFTTrainer)`` (or ``quantized(SFTTrainer, "qat")``) makes the same class
on top of it; ``quantized(GRPOTrainer, "rl")`` keeps TRL's GRPO loss and adds the quantized base, our LoRA
(``quant={"lora": {"rank": 16}}``) and AQN on the rollouts (``aqn=``). The student is quantized with :func:`qatfactory.api.quantize_model` after the base class has
built the model (TRL loads a model name there), calibrated on the first ``calib_samples`` training samples
in file order, as our trainer does. The loss runs inside the model's forward (``Distiller.install``), so DDP,
DeepSpeed ZeRO-1/2 and accelerate's mixed precision wrap it as they wrap any forward (ZeRO-3 is refused:
:func:`check_zero_stage`).

``data_order="qatfactory"`` feeds the samples in ``qatfactory train``'s seeded order (data.Order with
``args.seed``) instead of a RandomSampler's: with the same settings the two trainers see the same batches.
``save_model`` also writes ``<output_dir>/student`` (the student with its format state: the folder
``qatfactory export`` / ``qatfactory verify --against`` take). ``ship`` ("vllm" | "sglang" | "llama_cpp", or
a dict of :func:`qatfactory.api.ship`'s arguments) exports and gates the student when training ends.
"""
from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Mapping
from typing import Any, Dict, Optional, Union

import torch
from transformers import Trainer, TrainerCallback

from .. import _fsutil, api
from ..exitcodes import UsageError
from ..faces.ship import export_lines
from ..train.data import Order
from .distill import Distiller, method_loss

# qad / qat: our loss in the Trainer; rl: the trainer's own loss (TRL's GRPO, ...), with the quantized base,
# our LoRA on it (quant={"lora": {...}}) and AQN around the rollouts
METHODS = ("qad", "qat", "rl")


def _no_shm_comm_on_cpu() -> None:
    """DeepSpeed's shared-memory collective is JIT-compiled (minutes) when a CPU process group starts; the
    Trainer starts it when TrainingArguments are built, so this runs on import, before them (as
    train/runtime.py's init_distributed does for our own loop). gloo does the collectives instead."""
    if torch.cuda.is_available() or importlib.util.find_spec("deepspeed") is None:
        return
    import deepspeed.ops  # noqa: PLC0415 (only where DeepSpeed is installed)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


_no_shm_comm_on_cpu()
_COPY = "copy"      # teacher= default of QAD: the model itself before quantization (method.teacher_path=null)


class SeededOrder(torch.utils.data.Sampler):
    """The training order of ``qatfactory train`` (data.Order: a permutation per epoch, seeded by seed +
    epoch); each pass over the sampler is the next epoch."""

    def __init__(self, n: int, seed: int):
        self.order, self.epoch = Order(n, seed), 0

    def __len__(self) -> int:
        return self.order.n

    def __iter__(self):
        e, self.epoch = self.epoch, self.epoch + 1
        return iter(self.order.take(e * self.order.n, self.order.n))


def check_zero_stage(ds_config: Dict[str, Any]) -> None:
    """Refuse DeepSpeed ZeRO-3 here: the loss reads the head weight outside the module hooks that gather a
    partitioned parameter, and the teacher would have to be partitioned the same way; `qatfactory train`
    runs ZeRO-3 (train.zero_stage=3)."""
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage == 3:
        raise UsageError("DeepSpeed zero_optimization.stage=3 with a qatfactory Trainer: not supported here; allowed: "
                         "stage 0, 1 or 2 (ZeRO-3 runs in `qatfactory train train.zero_stage=3`)")


def _aqn(model, aqn, args):
    """nn.noise.AQN over the run's steps from ``aqn`` (True: method.rl.aqn's defaults; a dict of its fields)."""
    if not aqn:
        return None
    from ..nn.noise import AQN  # noqa: PLC0415
    from ..train.rl.losses import AQNConfig  # noqa: PLC0415 (the CLI's method.rl.aqn fields and defaults)
    d = {} if aqn is True else dict(aqn)
    known = {f for f in AQNConfig.__dataclass_fields__} - {"enabled"}
    bad = sorted(set(d) - known)
    if bad:
        raise UsageError(f"aqn: unknown field(s) {bad}; allowed: {sorted(known)} (method.rl.aqn.*)")
    c = AQNConfig(**{**d, "enabled": True})
    if args.max_steps is None or args.max_steps <= 0:
        raise UsageError("aqn= needs max_steps > 0 in the TrainingArguments (its schedule spans the run's steps)")
    try:
        return AQN(model, args.max_steps, c.sigma_start, c.sigma_end, c.stages, c.indexing, c.resample, c.seed,
                   include_final_norm=c.include_final_norm)
    except ValueError as e:
        raise UsageError(f"aqn: {e}") from None


def _ship_request(ship, output_dir: str) -> Optional[Dict[str, Any]]:
    if ship is None or ship is False:
        return None
    req = {"engine": ship} if isinstance(ship, str) else dict(ship)
    bad = sorted(set(req) - {"engine", "flavour", "out", "verify", "source_dir"})
    if bad:
        raise UsageError(f"ship: unknown field(s) {bad}; allowed: engine, flavour, out, verify, source_dir")
    req.setdefault("engine", api.DEFAULT_ENGINE)
    from ..exporters import list_exporters  # noqa: PLC0415
    if req["engine"] not in list_exporters():
        raise UsageError(f"ship: engine={req['engine']!r}; allowed: {list_exporters()}")
    req.setdefault("out", os.path.join(output_dir, f"export-{req['engine']}"))
    return req


class QuantizationMixin:
    """Fake quantization, the frozen teacher and our loss for a ``transformers.Trainer`` subclass (put it
    first: ``class MyTrainer(QuantizationMixin, SFTTrainer)``). Keyword arguments, beside the base class's:

    * ``method``: ``qad`` (distil from ``teacher``; the class default of QADTrainer), ``qat`` (CE on labels) or
      ``rl`` (the base trainer's own loss, e.g. TRL's GRPO: quantization, our LoRA and AQN only).
    * ``format``: a format recipe (``qatfactory train format=``; default nvfp4_w4a16) or a QuantConfig;
      ``quant``: ``quant.*`` fields over the recipe. A model that is already quantized is kept as it is.
    * ``teacher``: a model, a model folder or a top-k cache folder (batches then carry ``sample_ids``);
      default for qad: a frozen copy of the model before quantization.
    * ``loss``: a kind or a dict of ``method.loss`` fields (default: the method recipe's).
    * ``calib`` / ``calib_samples`` / ``calib_method``: calibration samples (default: the first
      ``calib_samples`` of train_dataset), how many, ``quant.calib_method``.
    * ``data_order``: ``"trainer"`` (the base class's sampler) or ``"qatfactory"`` (:class:`SeededOrder`).
    * ``ship``: an engine name or a dict of :func:`qatfactory.api.ship` arguments: exported and gated at the
      end of ``train()``; ``trainer.shipped`` holds the result.
    * ``aqn`` (method=rl): True or a dict of ``method.rl.aqn`` fields: adaptive quantization noise on the norm
      gains while the trainer samples rollouts (``_generate``, TRL's rollout method), clean for the loss. Not a
      TrainerCallback: a callback's hooks cannot tell a step's rollout from its loss forward.
    """

    qatfactory_method = "qad"
    qatfactory = None           # the Distiller (qad / qat), set once the model is quantized
    _qf_aqn = None              # nn.noise.AQN (rl with aqn=)

    def __init__(self, *args, method: Optional[str] = None, format: Union[str, Any] = api.DEFAULT_FORMAT,
                 quant: Optional[Dict[str, Any]] = None, teacher: Any = _COPY, loss: Any = None, calib=None,
                 calib_samples: int = api.CALIB_SAMPLES, calib_method: Optional[str] = None,
                 data_order: str = "trainer", ship: Union[None, str, Dict[str, Any]] = None,
                 aqn: Union[None, bool, Dict[str, Any]] = None, **kwargs):
        method = method or self.qatfactory_method
        if method not in METHODS:
            raise UsageError(f"method={method}: allowed: {list(METHODS)} (other methods run in `qatfactory train`)")
        if data_order not in ("trainer", "qatfactory"):
            raise UsageError(f"data_order={data_order!r}; allowed: ['trainer', 'qatfactory']")
        qcfg = api.quant_config(format, **(quant or {}))          # a bad format fails before any work
        if method == "rl":
            if loss is not None or (teacher is not _COPY and teacher is not None):
                raise UsageError("method=rl keeps the trainer's own loss: loss= and teacher= do not apply")
            lcfg = None
        else:
            if aqn:
                raise UsageError(f"aqn= with method={method}: AQN perturbs rollouts; allowed with method=rl")
            lcfg = method_loss(method, loss)
        if method == "qat" and lcfg.needs_teacher:
            raise UsageError(f"method.loss.kind={lcfg.kind!r} with method=qat: qat trains on CE; use method=qad")
        self.qatfactory_data_order = data_order
        self.shipped = None
        super().__init__(*args, **kwargs)
        self._qf_ship = _ship_request(ship, self.args.output_dir)
        if self._qf_ship is not None and self.args.should_save:
            # checked now, not after hours of training: an existing target must be an export of ours or empty
            _fsutil.check_replaceable(self._qf_ship["out"], ("export",), "ship.out")
        if getattr(self, "is_deepspeed_enabled", False):
            check_zero_stage(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        model = self.model
        prepared = getattr(model, "_qf_config", None) is not None
        self.qatfactory_method = method
        if lcfg is not None and lcfg.needs_teacher and teacher is _COPY:
            if prepared:
                raise UsageError("teacher: the model is already quantized, so it cannot be its own teacher; give "
                                 "teacher= (the unquantized model, its folder or a top-k cache)")
            teacher = copy.deepcopy(model)
        if lcfg is not None and not lcfg.needs_teacher and teacher is not _COPY and teacher is not None:
            raise UsageError(f"teacher= with method={method} (loss {lcfg.kind}): nothing distills from it")
        if not prepared:
            if calib is None and self.train_dataset is not None and hasattr(self.train_dataset, "__getitem__"):
                n = min(calib_samples, len(self.train_dataset))
                # token samples only: a prompt dataset (GRPO) holds text, and a format with dynamic scales
                # needs no samples (W4A4 / KV formats then ask for calib= by name)
                calib = [x for x in (self.train_dataset[i] for i in range(n))
                         if isinstance(x, Mapping) and "input_ids" in x] or None
            api.quantize_model(model, qcfg, calib=calib, calib_samples=calib_samples, calib_method=calib_method)
        self.qatfactory = self._qf_aqn = None
        if method == "rl":
            self._qf_aqn = _aqn(model, aqn, self.args)
        else:
            self._qf_loss_setup(model, teacher, lcfg)
        if self._qf_ship is not None:
            self.add_callback(_ShipAtEnd(self))

    def _qf_loss_setup(self, model, teacher, lcfg) -> None:
        self.qatfactory = Distiller(teacher if lcfg.needs_teacher else None, lcfg, device=self.args.device)
        self.qatfactory.install(model)
        # the loss is a mean over this micro-batch's counted tokens, as in `qatfactory train`: the Trainer
        # divides it by the accumulation steps (not by its own item count)
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False

    # ---------------------------------------------------------------- the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The method's loss (:class:`qatfactory.integrations.distill.Distiller`) on one batch; with
        method=rl the trainer's own."""
        if self.qatfactory is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        if "input_ids" not in inputs:
            raise UsageError(f"a batch without input_ids (keys {sorted(inputs)}); allowed: token batches of a causal LM")
        attn = inputs.get("attention_mask")
        if attn is None and "position_ids" in inputs:
            raise UsageError("padding_free / packed batches (position_ids, no attention_mask): allowed: padded "
                             "batches with an attention_mask (padding_free=False)")
        loss = self.qatfactory.loss(model, inputs["input_ids"], attn, inputs.get("labels"), inputs.get("sample_ids"))
        return (loss, {"loss": loss}) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        """The Trainer's log, with ``kl`` beside ``loss`` when the loss is exactly the mean KL(teacher ||
        student), as ``qatfactory train`` records it (its trackers then name it train/kl on both paths)."""
        c = self.qatfactory.cfg if self.qatfactory is not None else None
        if self._qf_aqn is not None and self._qf_aqn.last:
            logs = {**logs, **{f"aqn/{k}": v for k, v in self._qf_aqn.last.items()}}
        pure_kl = c is not None and c.kind == "forward_kl" and (c.ce_weight, c.kd_weight, c.temperature) == (0, 1, 1)
        if pure_kl and "loss" in logs:
            logs = {**logs, "kl": logs["loss"]}
        return super().log(logs, *args, **kwargs)

    def _generate(self, *args, **kwargs):
        """TRL's rollout sampling (GRPOTrainer._generate), under AQN's noise when ``aqn=`` asks: the noise is
        on for the sampling only, and the loss forward after it sees the clean model (nn/noise.py)."""
        if self._qf_aqn is None:
            return super()._generate(*args, **kwargs)
        with self._qf_aqn.rollout(self.state.global_step):
            return super()._generate(*args, **kwargs)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if getattr(self, "qatfactory", None) is not None and self._signature_columns is not None \
                and "sample_ids" not in self._signature_columns:
            self._signature_columns = list(self._signature_columns) + ["sample_ids"]   # a top-k cache reads them

    def _get_train_sampler(self, *args, **kwargs):
        if getattr(self, "qatfactory_data_order", "trainer") == "qatfactory":
            ds = args[0] if args else kwargs.get("train_dataset", self.train_dataset)
            return SeededOrder(len(ds if ds is not None else self.train_dataset), self.args.seed)
        return super()._get_train_sampler(*args, **kwargs)

    # ---------------------------------------------------------------- the student, the export
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The base class's save, and (outside checkpoints) ``<output_dir>/student``: the student with its
        format state (quantize.save_student), what ``qatfactory export`` takes."""
        super().save_model(output_dir, _internal_call=_internal_call)
        if not _internal_call:
            self.save_student(os.path.join(output_dir or self.args.output_dir, "student"))

    def save_student(self, out_dir: str) -> Optional[str]:
        """Write the student with its format state to ``out_dir`` (rank 0)."""
        if self.args.should_save:       # ZeRO-0/1/2 (ZeRO-3 is refused): every rank holds the full weights
            api.save(self.accelerator.unwrap_model(self.model), out_dir, source_dir=self._source_dir())
        return out_dir

    def _source_dir(self) -> Optional[str]:
        """Where the export copies the tokenizer from: a model folder the model was loaded from, else the
        output_dir when the trainer saved the tokenizer there."""
        src = getattr(getattr(self.model, "config", None), "_name_or_path", None)
        if src and os.path.isfile(os.path.join(src, "config.json")):
            return src
        out = self.args.output_dir
        if os.path.isfile(os.path.join(out, "tokenizer_config.json")):
            return out
        return None

    def ship(self, engine: str = api.DEFAULT_ENGINE, flavour: Optional[str] = None, out: Optional[str] = None, *,
             verify: bool = True, force: bool = False, source_dir: Optional[str] = None):
        """Convert, export and gate the student now (:func:`qatfactory.api.ship`; rank 0, the others wait): the
        Shipped on rank 0, None elsewhere. The gate's lines are printed."""
        out = out or os.path.join(self.args.output_dir, f"export-{engine}")
        if self.processing_class is not None and self.args.should_save and source_dir is None \
                and self._source_dir() is None:
            self.processing_class.save_pretrained(self.args.output_dir)
        shipped = None
        if self.args.should_save:
            lm = self.accelerator.unwrap_model(self.model)
            was = lm.training
            lm.eval()
            try:
                shipped = api.ship(lm, engine, flavour, out, verify=verify, force=force,
                                   source_dir=source_dir or self._source_dir())
            finally:
                lm.train(was)
            for line in export_lines(shipped.summary()):
                print(line, flush=True)
        self.accelerator.wait_for_everyone()
        self.shipped = shipped
        return shipped


class _ShipAtEnd(TrainerCallback):
    """Ships the trainer's student when training ends (the mixin's ``ship=``)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        r = self.trainer._qf_ship
        # force: the target was checked when the trainer was built (empty, or an earlier export of ours)
        self.trainer.ship(r["engine"], r.get("flavour"), r["out"], verify=r.get("verify", True), force=True,
                          source_dir=r.get("source_dir"))


class ShipCallback(TrainerCallback):
    """For a plain ``Trainer`` training a model quantized with :func:`qatfactory.api.quantize_model`: export
    and gate it when training ends (rank 0; the full weights, as ZeRO-0/1/2 hold them).
    ``shipped`` holds the result."""

    def __init__(self, engine: str = api.DEFAULT_ENGINE, out: Optional[str] = None, flavour: Optional[str] = None,
                 verify: bool = True, source_dir: Optional[str] = None):
        self.req = {"engine": engine, "out": out, "flavour": flavour, "verify": verify, "source_dir": source_dir}
        self.shipped = None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not args.should_save:
            return
        out = self.req["out"] or os.path.join(args.output_dir, f"export-{self.req['engine']}")
        self.shipped = api.ship(model, self.req["engine"], self.req["flavour"], out, verify=self.req["verify"],
                                force=True, source_dir=self.req["source_dir"])
        for line in export_lines(self.shipped.summary()):
            print(line, flush=True)


def quantized(trainer_cls: type, method: str = "qad") -> type:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass: TRL's SFTTrainer, ...) with
    :class:`QuantizationMixin` in front, training by ``method`` (qad | qat)."""
    if method not in METHODS:
        raise UsageError(f"method={method}: allowed: {list(METHODS)}")
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise UsageError(f"quantized({trainer_cls!r}): allowed: transformers.Trainer or a subclass of it")
    name = f"{method.upper()}{trainer_cls.__name__}"
    return type(name, (QuantizationMixin, trainer_cls), {"qatfactory_method": method,
                                                         "__doc__": f"{trainer_cls.__name__} with {method}"})


class QADTrainer(QuantizationMixin, Trainer):
    """``transformers.Trainer`` with quantization-aware distillation (``qatfactory train method=qad``)."""

    qatfactory_method = "qad"


class QATTrainer(QuantizationMixin, Trainer):
    """``transformers.Trainer`` with quantization-aware training on the labels (``qatfactory train method=qat``)."""

    qatfactory_method = "qat"
