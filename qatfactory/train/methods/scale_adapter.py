"""method=scale_adapter: train the block scales of a native NVFP4 / MXFP4 checkpoint (Scale-QLoRA), as
hooks of the one loop.

    qatfactory train method=scale_adapter model.path=<native 4-bit export> data.train=[sft.jsonl] export=vllm

    run_dir/scales.safetensors   the task's scale bytes (native.save_scale_file): the merge, a few % of the
                                 checkpoint, applies onto the base's code plane (``qatfactory scales``)
    run_dir/export-<engine>/     when export.enabled (shipped by the face, qatfactory.faces.ship): the base's codes
                                 + these scale bytes, through the gate with two more rows: codes == the
                                 base's (Student.native_base), logits == the training forward
                                 (Student.training_logits)

The model (native.build_model): every 4-bit linear a ScaleAdapterLinear (codes and scale bytes uint8
buffers, so ZeRO neither casts nor partitions them; the per-tensor scale frozen, so still shared across
fused shards), theta the only trainable tensors, everything else frozen. The loss is next-token CE on the
masked targets (e.g. the assistant turn of chat records). After every optimizer step
nn.scale_adapter.limit_changed keeps at most method.scale.max_changed of the blocks off the base's bytes
(auto: 0.3 % on MXFP4's power-of-two grid, where AdamW would otherwise flip thousands of blocks by a factor
of 2 in the same step; no limit on NVFP4's E4M3). Checkpoints hold theta and the optimizer like any run's,
so a run resumes; ZeRO-3 is refused (tested: 0-2; the offsets are 1/16 or 1/32 of the weights, and ZeRO-2
already partitions their optimizer).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ... import native as NT
from ...exitcodes import BadInputError, UsageError
from ...nn import scale_adapter as SA
from ..data import load_tokenizer
from ..runtime import DTYPES
from ..student import StudentLM
from .base import Context, Method, Needs, Student


def _tokenizer(cfg, ck: NT.NativeCheckpoint):
    if cfg.model.tokenizer or ck.source_dir:
        return load_tokenizer(cfg.model.tokenizer or ck.source_dir)
    if ck.gguf_file:
        from transformers import AutoTokenizer  # noqa: PLC0415 (heavy: transformers)
        return AutoTokenizer.from_pretrained(str(ck.path), gguf_file=ck.gguf_file)
    raise BadInputError(f"{ck.path}: no tokenizer files; give model.tokenizer=<a tokenizer directory>")


def _refresh_masters(engine) -> None:
    """After limit_changed wrote theta in the module: the optimizer's own fp32 copies (DeepSpeed's ZeRO-1/2 and
    bf16 wrappers keep them) re-read it, its moments kept; a plain torch optimizer steps the module's tensors."""
    opt = engine.optimizer
    if opt is not None and hasattr(opt, "refresh_fp32_params"):
        opt.refresh_fp32_params()


@torch.no_grad()
def training_logits(lm, ck: NT.NativeCheckpoint, prompt: List[int]):
    """(logits [T, V] float32 on CPU, how): the trained module itself when it already runs float32 on the
    CPU; else a float32 CPU copy of it (the same ScaleAdapterLinear code, the same scale bytes)."""
    ids = torch.tensor([prompt])
    on_cpu_fp32 = all(p.device.type == "cpu" and (not p.is_floating_point() or p.dtype == torch.float32)
                      for p in lm.parameters())
    was = lm.training
    if on_cpu_fp32:
        lm.eval()
        out = lm(input_ids=ids, use_cache=False).logits[0].float()
        lm.train(was)
        return out, "the trained module (float32, CPU)"
    cp = copy.deepcopy(lm).to("cpu").float().eval()
    return cp(input_ids=ids, use_cache=False).logits[0].float(), "a float32 CPU copy of the trained module"


def fraction(summary: Dict[str, Any]) -> float:
    """The scale file's size as a fraction of the checkpoint's tensor bytes."""
    return summary["scale_file_bytes"] / max(summary["checkpoint_bytes"], 1)


class ScaleAdapter(Method):
    name = "scale_adapter"
    summary = "scale-only adapters on a native 4-bit checkpoint: codes frozen, block scales trained"
    needs = Needs(native_base=True)
    options, options_key = SA.ScaleAdapterConfig, "scale"
    quant_start_refusal = "method=scale_adapter trains the scales of a native 4-bit base"
    zero3_refusal = ("tested: 0, 1, 2; the scale offsets are 1/16 (NVFP4) or 1/32 (MXFP4) of the weights, "
                     "ZeRO-2 partitions their optimizer")
    always_exports = True
    summary_keys = ("kl", "ce", "ppl", "top1")

    def validate(self, cfg) -> None:
        super().validate(cfg)
        cfg.method.scale.validate()
        if cfg.method.loss.needs_teacher:
            raise UsageError(f"method=scale_adapter trains on CE (method.loss.kind=ce); got {cfg.method.loss.kind!r}")

    def teacher(self, cfg) -> Optional[str]:
        return None

    def preflight(self, cfg, world: int) -> None:
        """A base that is not native 4-bit, or a target that cannot hold its bytes: refused before the run
        directory is made."""
        if not cfg.model.path:
            raise BadInputError("method=scale_adapter needs model.path=<a native NVFP4/MXFP4 export> (ModelOpt or "
                                "compressed-tensors safetensors directory, or a GGUF); it trains that checkpoint's "
                                "scales")
        self.ck = NT.read_native(cfg.model.path)
        self.target = NT.resolve_target(self.ck, cfg.method.scale.target)

    def build(self, ctx: Context) -> None:
        """The native checkpoint as a trainable model (its codes and scale bytes frozen buffers)."""
        cfg, s, ck = ctx.cfg, ctx.cfg.method.scale, self.ck
        model = NT.build_model(ck, self.target, s.param, s.rank, s.ste, list(s.targets), DTYPES[cfg.model.dtype])
        model.to(ctx.device)
        model.train()
        ctx.model, ctx.tokenizer, ctx.source_dir = model, _tokenizer(cfg, ck), ck.source_dir

    def prepare(self, ctx: Context) -> None:
        s, ck = ctx.cfg.method.scale, self.ck
        self.max_changed = SA.default_max_changed(self.target, s.param) if s.max_changed is None \
            else float(s.max_changed)
        if ctx.rank == 0:
            nb = ck.nbytes()
            n = sum(p.numel() for p in SA.parameters(ctx.model) if p.requires_grad)
            lim = "no limit" if self.max_changed >= 1 else f"at most {self.max_changed:.2%} of the blocks"
            ctx.say(f"scale adapter on {ck.container} {ck.layout} ({ck.base_format} -> target {self.target}): "
                    f"{len(SA.modules(ctx.model))} linears, {n:,} trainable offsets ({s.param}); codes "
                    f"{nb['codes']:,} B frozen, scales {nb['scales']:,} B; changed scale bytes: {lim} "
                    f"(method.scale.max_changed)")

    def module(self, ctx: Context):
        # the loss module without a method: next-token CE of method.loss (a scale adapter has no loss of its own)
        return StudentLM(ctx.model, ctx.cfg.method.loss)

    def parameters(self, ctx: Context, module) -> List[torch.nn.Parameter]:
        return [p for p in SA.parameters(ctx.model) if p.requires_grad]

    def begin(self, ctx: Context, state: Dict[str, Any]) -> None:
        self.lm = ctx.engine.module.lm

    def train_step(self, ctx: Context, batch) -> torch.Tensor:
        return ctx.forward(batch, None)

    def after_step(self, ctx: Context) -> None:
        self.pulled = SA.limit_changed(self.lm, self.max_changed)   # the same theta on every rank: the same pull-back
        if self.pulled:
            _refresh_masters(ctx.engine)

    def record(self, ctx: Context, loss_sum: torch.Tensor, micro: int) -> Dict[str, Any]:
        rec = super().record(ctx, loss_sum, micro)
        rec["scales/pulled_back"] = self.pulled
        t = ctx.cfg.train
        step = ctx.step + 1
        if step % t.log_every == 0 or step == t.max_steps:
            rec.update(SA.scale_stats(self.lm))       # also raises on a NaN offset (a diverged run)
        return rec

    def progress(self, ctx: Context, rec: Dict[str, Any]) -> Dict[str, Any]:
        return {"loss": rec["loss"], "changed": f"{rec.get('scales/changed', float('nan')):.4f}", "lr": rec["lr"]}

    def evaluate(self, ctx: Context) -> Optional[Dict[str, Any]]:
        r = super().evaluate(ctx)
        r.update(SA.scale_stats(ctx.engine.module.lm))
        return r

    def export(self, ctx: Context) -> Student:
        """Rank 0: the scale file, and (export.enabled) the merged model for the face to ship, with the
        gate's two extra rows: the export's code plane must be the base's, its logits the training
        forward's."""
        cfg, lm, ck = ctx.cfg, ctx.model, self.ck
        student = Student(model=lm)
        f = Path(ctx.run_dir) / "scales.safetensors"
        # the trust region the run held the bytes to goes into the file: an apply refuses bytes outside it
        meta = NT.save_scale_file(lm, ck, f, task=cfg.method.scale.task, max_changed=self.max_changed)
        nb = ck.nbytes()
        self.out = dict(scale_file=str(f), scale_file_bytes=f.stat().st_size, checkpoint_bytes=nb["total"],
                        code_plane_sha256=meta["base_code_plane_sha256"], scales_final=SA.scale_stats(lm))
        if cfg.export.enabled:
            student.converted = NT.merged_converted(lm, ck)
            student.native_base = str(ck.path)
            student.training_logits = lambda prompt: training_logits(lm, ck, prompt)
        return student

    def summary_entries(self, ctx: Context) -> Dict[str, Any]:
        out = {"base": str(self.ck.path), "base_container": self.ck.container, "format": self.target}
        out.update(getattr(self, "out", {}) or {})
        return out
