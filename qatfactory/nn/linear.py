"""QuantLinear: an nn.Linear whose weight (and, for W4A4, input) is fake-quantized.

Keeps the original ``weight``/``bias`` Parameter objects under the same names, so the HF state
dict keys do not change; quantizer state sits in ``weight_quant.*`` / ``input_quant.*``.
Members of an engine-fused group (q/k/v, gate/up) share one per-tensor amax: in ``dynamic`` mode
each member reads all members' weights every forward (under ZeRO-3 call
``qatfactory.quantize.register_zero3_external_params`` so they are gathered).

Inside the trainer (``step_cache.enabled()``) fq(W) is computed once per optimizer step and kept
(nn/weight_cache.py): every micro-batch forward, the backward and evaluation read the kept tensor,
with the same bits and gradients as the per-forward path. The ParetoQ grids' learnable scales train
through the quantizer and cannot be kept: there the trainer batches all linears of a format into a few
calls per forward instead (nn/lowbit_batch.py), through the instance hook ``WEIGHT_HOOK``: an object
there whose ``lookup(module)`` gives fq(W) for this forward (with its graph), or None for the module's
own path. This module knows only the hook; the lever that fills it imports this one, not the reverse.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from . import step_cache, weight_cache
from .fake_quant import ActQuantizer, quant_kwargs
from .lora import LoRA
from .lowbit import make_weight_quantizer

# instance attribute a training lever may set (module docstring); absent: the module's own path
WEIGHT_HOOK = "_qf_weight_hook"


class QuantLinear(nn.Module):
    def __init__(self, linear: nn.Linear, weight_format: str, strategy: str = "dynamic",
                 act_format: Optional[str] = None, ste: str = "identity", name: str = ""):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.qname = name
        dev = self.weight.device
        self.weight_quant = make_weight_quantizer(weight_format, strategy, (1, self.out_features, self.in_features),
                                                  ste, device=dev)
        self.input_quant = ActQuantizer(act_format, device=dev) if act_format else None
        if self.input_quant is not None:
            self.input_quant.owner = name
        self.lora: Optional[LoRA] = None
        self._group: List["QuantLinear"] = [self]     # plain list: peers are not submodules
        # a tied output head: the QuantEmbedding whose weight and quantizer this shares (nn/embedding.py)
        object.__setattr__(self, "tied_to", None)
        # recompute fq(W), fq(x) in backward instead of saving them: None = when the CUDA kernels run
        self.recompute_fq: Optional[bool] = None
        # False: the plain linear (the full-precision phase of train.quant_start; quantize.set_quantization)
        self.quant_enabled = True

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"

    @property
    def weight_format(self) -> str:
        return self.weight_quant.fmt_name

    def add_lora(self, rank: int, alpha: float) -> LoRA:
        self.lora = LoRA(self.in_features, self.out_features, rank, alpha, device=self.weight.device)
        return self.lora

    def merged_weight(self) -> torch.Tensor:
        """The weight the quantizer sees: W, or W + (alpha/r)·B·A (float32) with LoRA."""
        return self.weight if self.lora is None else self.lora.merge(self.weight)

    def group_amax(self) -> torch.Tensor:
        """Shared per-tensor amax [1]: max |W| over the fused group, from detached weights.

        One reduction launch for the whole group (no |W| temporaries); inside the trainer's
        ``step_cache.enabled()`` the group's first member keeps it until the next optimizer step
        or until any member's weight changes in place (its version counter)."""
        epoch = step_cache.current()
        lead = self._group[0]
        if epoch is None:
            return self._group_amax_now()
        if hasattr(self.weight, "ds_id"):
            key = (epoch,)      # ZeRO-3: each gather is new storage; the trainer's epochs alone decide
        else:
            deps = [t for m in self._group
                    for t in ((m.weight,) if m.lora is None else (m.weight, *m.lora.parameters()))]
            key = (epoch,) + weight_cache.version_key(deps)
        hit = getattr(lead, "_amax_cache", None)
        if hit is not None and hit[0] == key:
            return hit[1]
        a = self._group_amax_now()
        lead._amax_cache = (key, a)
        return a

    def _group_amax_now(self) -> torch.Tensor:
        # under no_grad: with LoRA, merged_weight() would otherwise record B·A in the graph (saving A and B)
        # only to be detached -- and a cache hit in a gradient-checkpointing recompute would then save
        # fewer tensors than the original forward did (torch's CheckpointError)
        with torch.no_grad():
            return weight_cache.group_amax_now([m.merged_weight() for m in self._group])

    def quantized_weight(self) -> torch.Tensor:
        w = self.merged_weight()
        amax = self.group_amax() if self.weight_quant.strategy == "dynamic" else None
        return self.weight_quant(w.unsqueeze(0), amax)[0].to(self.weight.dtype)

    def _quant_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.input_quant is None else self.input_quant(x)

    def recompute_in_backward(self) -> bool:
        """Whether the training forward keeps only x and W and recomputes their fake quant in the
        backward: ``self.recompute_fq`` when set, else when the fused CUDA kernels run both quantizers
        (a recompute is one cheap launch there; with the torch emulator, e.g. on a CPU, it would
        double the quantizers' cost, so F.linear keeps the quantized copies instead)."""
        if self.recompute_fq is not None:
            return bool(self.recompute_fq)
        wq = self.weight_quant
        key = (self.weight.device, self.weight.dtype, wq.strategy, wq.fmt_name)
        hit = getattr(self, "_recompute_key", None)
        if hit is not None and hit[0] == key:
            return hit[1]
        fmt = wq.fmt
        probe = self.weight.detach()
        # ggml types that take an importance matrix may run the emulator (checking would sync the host)
        ok = not wq.uses_imatrix and kernels.why_not(probe, fmt.name, wq.ste, **quant_kwargs(
            fmt, amax=torch.ones(1) if wq.strategy == "dynamic" else None, scales=wq.scale_bytes())) is None
        if ok and self.input_quant is not None:
            ok = kernels.why_not(probe, self.input_quant.fmt_name) is None
        self._recompute_key = (key, ok)
        return ok

    def _wc_site(self) -> weight_cache.Site:
        s = self.__dict__.get("_wc_site_obj")
        if s is None:
            s = self.__dict__["_wc_site_obj"] = weight_cache.site(self, "weight", "weight_quant")
        return s

    def _plan(self):
        """The launch plan, built on the first call: (weight, weight quantizer, input quantizer, whether
        the training forward takes _QuantLinearFn, whether W's amax is dynamic, the cache site). Checked
        by identity each call (a replaced weight, quantizer or setting rebuilds it); saves the module
        attribute lookups and the recompute decision per call."""
        d = self.__dict__
        w = self._parameters["weight"]
        wq = self._modules["weight_quant"]
        iq = self._modules.get("input_quant")
        p = d.get("_qf_plan")
        state = (wq.strategy, self.recompute_fq, self.lora is None, w.dtype, w.device)
        if p is not None and p[0] is w and p[1] is wq and p[2] is iq and p[6] == state:
            return p
        fn = self.lora is None and wq.strategy != "learnable" and self.recompute_in_backward()
        p = d["_qf_plan"] = (w, wq, iq, fn, wq.strategy == "dynamic", self._wc_site(), state)
        return p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fq_x(x) @ fq_w(W)^T + b. The operands come from one of: the plain linear (quantization off);
        _QuantLinearFn (training where the recompute-in-backward plan holds), with the step's kept fq(W)
        when there is one; else F.linear of fq_x(x) and, in this order of preference, the step's kept
        fq(W), a lever's weight (``WEIGHT_HOOK``), or fq(W) computed now."""
        fn_args = None          # (amax, kept fq(W)) for _QuantLinearFn
        xq, wt = x, None
        if not self.quant_enabled:
            wt = self.merged_weight()
        else:
            w, wq, iq, fn, dynamic, site, _ = self._plan()
            e = weight_cache.lookup(site) if step_cache.weights_cached() else None
            if (fn and torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
                    and not (iq is not None and iq.calibrating)):
                fn_args = (e.amax, e.wq) if e is not None else (self.group_amax() if dynamic else None, None)
            else:
                xq = x if iq is None else iq(x)
                if e is not None:
                    wt = weight_cache.training_weight(site, e)
                else:
                    hook = self.__dict__.get(WEIGHT_HOOK)
                    wt = None if hook is None else hook.lookup(self)
                    if wt is None:
                        wt = self.quantized_weight()
        y = F.linear(xq, wt, self.bias) if fn_args is None else \
            _QuantLinearFn.apply(x, self._parameters["weight"], self.bias, self, *fn_args)
        return y

    @torch.no_grad()
    def pack(self, r0: int = 0, r1: Optional[int] = None):
        w = self.merged_weight().detach().unsqueeze(0)
        amax = self.group_amax() if self.weight_quant.strategy == "dynamic" else None
        return self.weight_quant.pack(w, 0, r0, self.out_features if r1 is None else r1, amax)


class _QuantLinearFn(torch.autograd.Function):
    """y = fq_x(x) @ fq_w(W)^T + b that keeps only x and W for the backward (tensors the graph
    holds anyway: W is the parameter, x is shared by the q/k/v or gate/up siblings), not the
    fake-quantized copies F.linear would save -- one weight-sized tensor per linear (the whole
    model's weights again, 1.3 GiB for a 1B model) and, for W4A4, one activation per sibling.
    The backward recomputes fq_x(x) and fq_w(W) (one kernel launch each; fq_w(W) not at all when
    the step's kept copy ``wq`` is given) and sends the matmul gradients through the quantizers'
    straight-through rules: the activation quantizer's and an ``identity`` weight rule pass the
    gradient as it is (no autograd call), a ``clipped`` weight rule goes through the recomputed
    quantizer (its saturation mask)."""

    @staticmethod
    def forward(ctx, x, w, bias, mod, amax, wq):
        with torch.no_grad():
            wqf = mod.weight_quant(w.unsqueeze(0), amax)[0].to(w.dtype) if wq is None else wq
            y = F.linear(mod._quant_input(x), wqf, bias)
        if wq is None:
            ctx.save_for_backward(x, w, amax)
        else:
            ctx.save_for_backward(x, w, amax, wq)
        ctx.mod = mod
        ctx.clipped = mod.weight_quant.ste == "clipped"
        return y

    @staticmethod
    def backward(ctx, gy):
        # runs with grad mode off (no double backward): the recomputes below build no graph
        saved = ctx.saved_tensors
        x, w, amax = saved[:3]
        wq = saved[3] if len(saved) > 3 else None
        mod = ctx.mod
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        clipped = ctx.clipped
        if wq is None and need_x:
            wq = mod.weight_quant(w.unsqueeze(0), amax)[0].to(w.dtype)
        g2 = gy.reshape(-1, gy.shape[-1])
        gx = gw = gb = None
        if need_x:
            gx = gy.matmul(wq)
            if gx.dtype != x.dtype:
                gx = gx.to(x.dtype)
        if need_w:
            xq = mod._quant_input(x)
            gq = g2.t().matmul(xq.reshape(-1, xq.shape[-1]))
            if clipped:
                with torch.enable_grad():
                    wd = w.detach().requires_grad_()
                    (gw,) = torch.autograd.grad(mod.weight_quant(wd.unsqueeze(0), amax)[0].to(w.dtype), wd, gq)
            else:
                gw = gq if gq.dtype == w.dtype else gq.to(w.dtype)
        if need_b:
            gb = g2.sum(0).to(gy.dtype)
        return gx, gw, gb, None, None, None
