"""Adaptive quantization noise (AQN, QeRL arXiv 2510.11696 §3.3): Gaussian noise on the norm gains
that feed the attention and MLP input projections, during rollouts only.

An RMSNorm ``y = g * x / rms(x)`` followed by q/k/v (or gate/up) is, with ``g -> g + z``, the same as
multiplying input channel ``j`` of each of those projections by ``1 + z_j / g_j``: per-channel
multiplicative weight noise without a second weight copy. q, k and v share one vector (the attention
input norm), gate and up another (the MLP input norm); o_proj and down_proj get none. Relative noise
is ``sigma / |g_j|``, logged as ``sigma_over_gain`` (median and max over channels).

**Norms are matched by role, per architecture, never by class.** NVlabs/QeRL tests
``isinstance(m, (Qwen2RMSNorm, LlamaRMSNorm))`` while walking vLLM's model, whose norms are vLLM's
own ``RMSNorm``: as written it matches nothing there (read, not executed; see methods.md). Here each
decoder layer's norm is found by the attribute that plays the role in that architecture:

    model_type                      attention input      MLP input                   gain
    llama, mistral, qwen2, qwen3    input_layernorm      post_attention_layernorm    g = w
    gemma3, gemma3_text             input_layernorm      pre_feedforward_layernorm   g = 1 + w

(Gemma-3's ``post_attention_layernorm`` / ``post_feedforward_layernorm`` act on block outputs, not
on projection inputs, and its gains are stored as offsets: adding z to w adds z to the gain.)
An unknown architecture is an error that names the supported ones.

Schedule: the run's steps are split into K equal stages; stage 0 adds nothing (the quantization
error is the only noise); stage k >= 1 decays exponentially from sigma_start to sigma_end:

    indexing="paper" (Eq. 8, Alg. 1):     sigma_k = s0 * (s1 / s0) ** ((k - 1) / (K - 1))
    indexing="code"  (NVlabs/QeRL):       sigma_k = s0 * (s1 / s0) ** ((k - 1) / (K - 2))

so only the code's indexing reaches sigma_end in the last stage. The stage of a step follows the
code: ``int(step // (total / K))``, capped at K - 1.

Noise is drawn in float32 from a generator seeded by (seed, step, draw) and added to a copy of each
gain; the parameter's own tensor is put back, untouched, when the rollout ends, so the loss forward
sees the clean model (noise removed exactly, not subtracted). ``resample="step"`` draws once per RL
step (the code and Alg. 1); ``"forward"`` draws again before every forward pass of the model (the
paper's text). In a bf16 model the noisy gain is rounded to bf16: a sigma far below the gain's bf16
spacing (2^-8 near 1) is mostly rounded away; ``sigma_eff`` logs the std of what was really added.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import torch
from torch import nn

# model_type -> (attention-input norm, MLP-input norm, gain offset)
NORM_ROLES: Dict[str, Tuple[str, str, float]] = {
    "llama": ("input_layernorm", "post_attention_layernorm", 0.0),
    "mistral": ("input_layernorm", "post_attention_layernorm", 0.0),
    "qwen2": ("input_layernorm", "post_attention_layernorm", 0.0),
    "qwen3": ("input_layernorm", "post_attention_layernorm", 0.0),
    "gemma3": ("input_layernorm", "pre_feedforward_layernorm", 1.0),
    "gemma3_text": ("input_layernorm", "pre_feedforward_layernorm", 1.0),
}


def stage_of(step: int, total_steps: int, stages: int) -> int:
    """The stage (0..K-1) of an RL step: K equal parts of the run."""
    if total_steps < 1 or stages < 1:
        raise ValueError(f"stage_of: total_steps={total_steps!r}, stages={stages!r}; allowed: ints >= 1")
    step = min(max(int(step), 0), total_steps)
    return min(int(step // (total_steps / stages)), stages - 1)


def stage_sigma(stage: int, sigma_start: float, sigma_end: float, stages: int, indexing: str = "code") -> float:
    if stage <= 0:
        return 0.0
    if stages < 3:
        raise ValueError(f"AQN stages={stages!r}; allowed: >= 3 (stage 0 plus a decay over >= 2 stages)")
    if indexing == "paper":
        e = (stage - 1) / (stages - 1)
    elif indexing == "code":
        e = (stage - 1) / (stages - 2)
    else:
        raise ValueError(f"AQN indexing={indexing!r}; allowed: ['code', 'paper']")
    return float(sigma_start * (sigma_end / sigma_start) ** e)


def sigma_at(step: int, total_steps: int, sigma_start: float, sigma_end: float, stages: int,
             indexing: str = "code") -> float:
    return stage_sigma(stage_of(step, total_steps, stages), sigma_start, sigma_end, stages, indexing)


def _decoder_layers(model: nn.Module) -> List[nn.Module]:
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) and hasattr(layers[0], "input_layernorm"):
            return list(layers)
    raise ValueError(f"{type(model).__name__}: no decoder layers (a ModuleList `layers` of blocks with "
                     f"`input_layernorm`) found")


def model_type(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    t = getattr(cfg, "model_type", None)
    if t is None:
        raise ValueError(f"{type(model).__name__}: no config.model_type; AQN matches norms per architecture")
    return str(t)


@dataclass
class NormTarget:
    name: str            # full parameter name, e.g. model.layers.0.input_layernorm.weight
    role: str            # "attn" | "mlp" | "final"
    param: nn.Parameter
    offset: float        # effective gain = offset + w


def find_norms(model: nn.Module, include_final: bool = False) -> List[NormTarget]:
    """The gains AQN perturbs, by role (see the table above)."""
    mt = model_type(model)
    if mt not in NORM_ROLES:
        raise ValueError(f"AQN: model_type {mt!r} has no norm-role mapping; supported: {sorted(NORM_ROLES)}")
    attn, mlp, off = NORM_ROLES[mt]
    names = {id(p): n for n, p in model.named_parameters()}
    out: List[NormTarget] = []
    for i, layer in enumerate(_decoder_layers(model)):
        for role, attr in (("attn", attn), ("mlp", mlp)):
            norm = getattr(layer, attr, None)
            w = getattr(norm, "weight", None)
            if not isinstance(w, nn.Parameter):
                raise ValueError(f"AQN: layer {i} of {mt!r} has no {attr}.weight (the {role}-input norm gain)")
            out.append(NormTarget(names[id(w)], role, w, off))
    if include_final:
        fin = [(n, p) for n, p in model.named_parameters() if n.endswith("model.norm.weight") or n == "norm.weight"]
        if len(fin) != 1:
            raise ValueError(f"AQN include_final_norm: expected one final norm gain, found {[n for n, _ in fin]}")
        out.append(NormTarget(fin[0][0], "final", fin[0][1], off))
    return out


class AQN:
    """Scheduled noise on the targets for the duration of :meth:`rollout`."""

    def __init__(self, model: nn.Module, total_steps: int, sigma_start: float = 1e-2, sigma_end: float = 5e-4,
                 stages: int = 10, indexing: str = "code", resample: str = "step", seed: int = 0,
                 include_final_norm: bool = False):
        if resample not in ("step", "forward"):
            raise ValueError(f"AQN resample={resample!r}; allowed: ['step', 'forward']")
        stage_sigma(1, sigma_start, sigma_end, stages, indexing)      # checks the arguments
        self.model, self.total_steps = model, int(total_steps)
        self.sigma_start, self.sigma_end, self.stages, self.indexing = sigma_start, sigma_end, int(stages), indexing
        self.resample, self.seed = resample, int(seed)
        self.targets = find_norms(model, include_final_norm)
        self.last: Dict[str, float] = {}

    def sigma(self, step: int) -> float:
        return sigma_at(step, self.total_steps, self.sigma_start, self.sigma_end, self.stages, self.indexing)

    def _draw(self, step: int, draw: int, sigma: float, originals) -> Dict[str, float]:
        g = torch.Generator().manual_seed(((self.seed * 1_000_003 + int(step)) * 1_000_003 + int(draw)) % (1 << 63))
        added_sq, n = 0.0, 0
        for t, orig in zip(self.targets, originals):
            z = torch.randn(orig.shape, generator=g, dtype=torch.float32) * sigma
            noisy = (orig.detach().float().cpu() + z).to(orig.dtype)
            t.param.data = noisy.to(orig.device)
            d = noisy.double() - orig.detach().double().cpu()
            added_sq += float((d * d).sum())
            n += d.numel()
        return {"sigma_eff": math.sqrt(added_sq / max(n, 1))}

    def gain_stats(self, sigma: float) -> Dict[str, float]:
        """sigma / |effective gain| over every perturbed channel: median and max."""
        if not self.targets:
            return {}
        g = torch.cat([(t.offset + t.param.detach().float().cpu()).abs().reshape(-1) for t in self.targets])
        rel = sigma / g.clamp(min=1e-30)
        return {"sigma_over_gain_median": float(rel.median()), "sigma_over_gain_max": float(rel.max()),
                "gain_abs_median": float(g.median())}

    @contextlib.contextmanager
    def rollout(self, step: int) -> Iterator[Dict[str, float]]:
        """Inside, the targets carry this step's noise; the yielded dict fills with the log values
        (sigma, stage, sigma_eff, sigma/|gain|). Outside, every gain is its original tensor again."""
        sigma = self.sigma(step)
        info: Dict[str, float] = {"sigma": sigma, "stage": float(stage_of(step, self.total_steps, self.stages))}
        if sigma == 0.0:
            info["sigma_eff"] = 0.0
            self.last = info
            yield info
            return
        info.update(self.gain_stats(sigma))
        originals = [t.param.data for t in self.targets]
        handle = None
        try:
            info.update(self._draw(step, 0, sigma, originals))
            if self.resample == "forward":
                count = [0]

                def pre(mod, args, kwargs):
                    count[0] += 1
                    info.update(self._draw(step, count[0], sigma, originals))
                    info["draws"] = float(count[0])

                handle = self.model.register_forward_pre_hook(pre, with_kwargs=True)
            yield info
        finally:
            if handle is not None:
                handle.remove()
            for t, orig in zip(self.targets, originals):
                t.param.data = orig
            self.last = info
