"""Typed run configuration: dataclasses registered in Hydra's ConfigStore, composed from recipes/.

    qatfactory train method=qad format=nvfp4_w4a16 model=smollm2_135m train.max_steps=200

Groups (recipes/<group>/<name>.yaml): ``model`` -> ``model``, ``format`` -> ``quant`` (a
:class:`qatfactory.quantize.QuantConfig`), ``method`` -> ``method`` (may also set ``train``/``quant``
keys through ``@package _global_``), ``train`` -> ``train``, ``export`` -> ``export``. Every value is
checked twice: by OmegaConf against these types while composing, and by :func:`validate` for
ranges and choices, with errors naming the field, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra import compose as hcompose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .._recipes import recipes_dir
from ..distill.losses import LossConfig, check_topk
from ..exitcodes import BadInputError, UsageError
from ..kernels import NVFP4_KERNELS
from ..nn.weight_cache import BATCH_MODES as WEIGHT_CACHE_BATCH
from ..quantize import QuantConfig
from . import compose_checks as CC
from . import methods as M
from . import trackers
from .data import ByteTokenizer, DataConfig
from .methods import (
    NO_QUANT,  # noqa: F401  (re-exported: quant.weight_format=none trains the plain model)
    quant_start,
)

TEACHERS = ("live", "cached")
SCHEDULES = ("constant", "cosine")
PRECISIONS = ("bf16", "fp32")
OPTIMIZERS = ("adamw_torch", "adamw_fused")
MODEL_DTYPES = ("bfloat16", "float32", "float16")
TINY_ARCHS = ("llama", "qwen3_moe")
# model.name of the random models (model.path and model.asset null) -> the model.tiny.arch it builds
TINY_NAMES = {"tiny_llama": "llama", "tiny_qwen3_moe": "qwen3_moe"}


@dataclass
class TinyModelConfig:
    """A random model for tests, smoke runs and benchmarks (no download): ``arch=llama`` builds
    transformers' LlamaForCausalLM, ``arch=qwen3_moe`` its Qwen3MoeForCausalLM (every layer a sparse
    MoE block: ``num_experts`` experts of width ``moe_intermediate_size``, ``num_experts_per_tok``
    routed per token, the experts held as fused 3-D tensors). The ``num_experts`` ..
    ``norm_topk_prob`` fields are read by qwen3_moe only; ``intermediate_size`` by llama only."""

    arch: str = "llama"            # llama | qwen3_moe
    vocab_size: int = 259          # the ByteTokenizer's vocabulary
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02   # larger: peakier random outputs (a teacher worth distilling)
    head_dim: Optional[int] = None    # qwen3_moe: None = hidden_size / num_attention_heads
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True       # Qwen3-MoE's released configs renormalise the top-k router weights


@dataclass
class ModelConfig:
    name: str = "tiny_llama"
    path: Optional[str] = None       # a local HF model directory
    asset: Optional[str] = None      # a packaged asset turned into a local dir once (qatfactory.assets)
    tokenizer: Optional[str] = None  # defaults to path; tiny models use the byte tokenizer
    dtype: str = "bfloat16"          # weight dtype when loaded (fp32 for exact CPU tests)
    init_seed: int = 0               # tiny models only
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class MethodConfig:
    """The settings every method reads (name: a registered method, train/methods/). A method with
    options of its own registers their dataclass with itself (Method.options, Method.options_key): the
    run's schema (:func:`run_schema`) then holds it at ``method.<options_key>`` (grpo / dapo:
    ``method.rl``, scale_adapter: ``method.scale``); ``options`` is the free block of a method that
    names no key (checked against its dataclass by the method)."""

    name: str = "qad"
    loss: LossConfig = field(default_factory=LossConfig)
    teacher: str = "live"             # live | cached
    teacher_path: Optional[str] = None   # default: the model itself before quantization
    teacher_cache: Optional[str] = None  # default: <run_dir>/teacher_cache
    topk: int = 64
    cache_dtype: str = "float32"
    calibrate: bool = True
    calib_samples: int = 8
    eval_teacher: bool = True         # qat/ptq: load the teacher to report KL/top-1 (off: CE/ppl only)
    options: Dict[str, Any] = field(default_factory=dict)   # a plugin method's options (Method.options)


@dataclass
class TrainConfig:
    zero_stage: int = 0
    precision: str = "bf16"
    optimizer: str = "adamw_torch"    # adamw_fused: DeepSpeed's FusedAdam (GPU only)
    lr: float = 5e-6                  # the QAD default: a small constant rate
    schedule: str = "constant"        # constant | cosine (warmup then cosine to min_lr_ratio * lr)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    max_steps: int = 100
    micro_batch: int = 1
    grad_accum: int = 1
    clip: float = 1.0
    grad_ckpt: bool = False
    eval_every: int = 50              # 0: only at the start and the end
    eval_samples: int = 0             # 0: all held-out samples
    save_every: int = 0               # 0: only at the end
    save_final: bool = True           # checkpoint at the end of the run (benchmarks turn it off)
    save_student: bool = True         # <run_dir>/student: quantize.save_student (input of `qatfactory export`)
    keep_last: int = 2
    log_every: int = 1
    seed: int = 0
    device: str = "auto"              # auto | cpu | cuda
    progress: bool = True
    plots: bool = True
    tensorboard: Optional[bool] = None  # None: TensorBoard logs when it is installed; true: say so when it is not
    # the trackers beside metrics.jsonl, as Hugging Face's report_to: [tensorboard, wandb, mlflow] (each must be
    # installed), [all] (those installed) or [none]; null: TensorBoard when installed (train.tensorboard).
    # Their metric names are the HF Trainer's: train/loss, train/learning_rate, train/kl, eval/kl (trackers.py)
    report_to: Optional[List[str]] = None
    # ParetoQ's full-precision-then-QAT schedule, run by the methods that support it (qat, qad;
    # train/methods/quant_start.py): the first round(quant_start * max_steps) steps train with
    # quantization off, then the scales are calibrated from the trained weights, quantization switches
    # on, the optimizer state starts afresh and the LR schedule restarts with peak quant_lr (None: lr)
    quant_start: float = 0.0
    quant_lr: Optional[float] = None
    # the host work of a step (train/ds_step.py; the same bits either way, tests/train/test_step_levers.py):
    # lean_step: DeepSpeed's bf16 ZeRO-0 step without its per-parameter overflow reads and copies, and no
    # gradient all-reduce on one rank; ds_timers: DeepSpeed's throughput timer (a device sync at every
    # forward and every step, for a report the trainer never prints)
    lean_step: bool = True
    ds_timers: bool = False
    # bf16 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer; needs zero_stage >= 1):
    # grad_accum_dtype=fp32, and immediate_grad_update folds each bf16 gradient into the fp32 buffer
    # as soon as it is computed (the bf16 gradient is then freed)
    grad_accum_dtype: Optional[str] = None
    immediate_grad_update: bool = False
    # DeepSpeed's ZeRO-0 bf16/fp16 wrappers run one zero-gradient optimizer step when they are built, so
    # AdamW's step counter starts at 1 and every bias correction is one step ahead (the first update is
    # 0.74x AdamW's at betas 0.9/0.95); ZeRO-1/2/3 and torch's AdamW start at 0. fresh_adam (default) clears
    # the optimizer state after the build when the build stepped it (only those wrappers do): ZeRO-0 then
    # trains ZeRO-1's bits (tests/train/test_step_levers.py), so a recipe trains the same under every stage;
    # false keeps DeepSpeed's own ZeRO-0 start
    fresh_adam: bool = True
    # less activation memory, the same bits (nn/lean_act.py): RMSNorms keep their bf16 input and the MLP
    # its gate and up outputs, recomputing the rest in the backward (a few launches per layer)
    lean_act: bool = False
    # the per-step fake-quant levers (train/levers.py; the same bits either way): weight_cache keeps fq(W)
    # for the optimizer step (nn/weight_cache.py; one more copy of the quantized weights in memory);
    # weight_cache_batch fills it in one launch per format and row length: auto (where the CUDA kernels
    # run) | always | never; lowbit_batch fake-quantizes the ParetoQ grids' learnable linears a few calls
    # per forward (nn/lowbit_batch.py); nvfp4_kernel picks the NVFP4 CUDA kernel (qatfactory/kernels)
    weight_cache: bool = True
    weight_cache_batch: str = "auto"
    lowbit_batch: bool = True
    nvfp4_kernel: str = "auto"
    # Ulysses sequence parallelism (train/seqpar.py): one sequence spread over this many ranks (1: off)
    sequence_parallel: int = 1


@dataclass
class ExportConfig:
    enabled: bool = False
    engine: str = "vllm"              # vllm | sglang | llama_cpp
    flavour: Optional[str] = None
    out_dir: Optional[str] = None     # default: <run_dir>/export-<engine>
    verify: bool = True               # reload the export with the engine's loader and compare (parity gate)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    run_dir: Optional[str] = None     # default: runs/<method>-<format>-<time>
    resume: Optional[str] = None      # "auto" (latest in run_dir) or a checkpoint directory
    plugins: List[str] = field(default_factory=list)   # modules imported first: they register methods


_SCHEMAS: Dict[tuple, type] = {}


def run_schema(plugins: Optional[List[str]] = None) -> type:
    """The RunConfig class of a run: ``method`` gains one typed block per method that registered options
    under a key (``method.rl``, ``method.scale``, a plugin's own), so a wrong key or type there is named
    while composing, like any other field. The blocks are the built-in methods' and those of the modules
    the run names in ``plugins`` (a plugin imported for another run in the same process adds nothing)."""
    names = [str(p) for p in plugins or []]
    blocks = {}
    for cls in M.REGISTRY.values():
        mod = cls.__module__
        own = mod.startswith(M.__name__ + ".") or any(mod == p or mod.startswith(p + ".") for p in names)
        if own and cls.options is not None and cls.options_key:
            have = blocks.setdefault(cls.options_key, cls.options)
            if have is not cls.options:
                raise ValueError(f"method {cls.name!r}: options key method.{cls.options_key} is already "
                                 f"{have.__module__}.{have.__qualname__}'s")
    sig = tuple(sorted((k, id(v)) for k, v in blocks.items()))
    if sig not in _SCHEMAS:
        method_cls = dataclasses.make_dataclass(
            "MethodConfig", [(k, v, field(default_factory=v)) for k, v in sorted(blocks.items())], bases=(MethodConfig,))
        method_cls.__module__ = __name__
        run_cls = dataclasses.make_dataclass(
            "RunConfig", [("method", method_cls, field(default_factory=method_cls))], bases=(RunConfig,))
        run_cls.__module__ = __name__
        _SCHEMAS[sig] = run_cls
    return _SCHEMAS[sig]


def method_options(key: str) -> str:
    """``name: type = default`` of each field of the options registered at method.<key> (an error names them)."""
    for cls in M.REGISTRY.values():
        if cls.options_key == key and cls.options is not None:
            users = [c.name for c in M.REGISTRY.values() if c.options_key == key]
            fields = []
            for f in dataclasses.fields(cls.options):
                d = f.default if f.default is not dataclasses.MISSING else (
                    f.default_factory() if f.default_factory is not dataclasses.MISSING else "?")
                t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
                fields.append(f"{f.name}: {t} = {d!r}")
            return f"method.{key} (method {', '.join(users)}): " + "; ".join(fields)
    return ""


def _choice(fld: str, v, allowed):
    if v not in allowed:
        raise ValueError(f"{fld}={v!r}; allowed: {list(allowed)}")


def check_tiny(t: TinyModelConfig, arch: str, name: str) -> None:
    """The random model's shape: the sizes transformers would otherwise reject deep inside its init
    (or accept and build something else), each named with what is allowed."""
    _choice("model.tiny.arch", t.arch, TINY_ARCHS)
    if t.arch != arch:
        raise ValueError(f"model.tiny.arch={t.arch!r} with model.name={name!r}, which builds {arch!r}; "
                         f"pick the recipe of the architecture: model={next(n for n, a in TINY_NAMES.items() if a == t.arch)}")
    ints = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings"]
    ints += ["intermediate_size"] if t.arch == "llama" else ["num_experts", "num_experts_per_tok",
                                                              "moe_intermediate_size"]
    for fld in ints:
        if int(getattr(t, fld)) < 1:
            raise ValueError(f"model.tiny.{fld}={getattr(t, fld)!r}; allowed: an int >= 1")
    if t.num_attention_heads % t.num_key_value_heads:
        raise ValueError(f"model.tiny.num_attention_heads={t.num_attention_heads} is not a multiple of "
                         f"model.tiny.num_key_value_heads={t.num_key_value_heads}; allowed: a multiple (grouped-query "
                         f"attention shares each KV head among the same number of query heads)")
    if t.arch == "llama" and t.head_dim is not None:
        raise ValueError(f"model.tiny.head_dim={t.head_dim!r} with model.tiny.arch='llama'; allowed: null (the Llama "
                         f"head is hidden_size / num_attention_heads)")
    if t.head_dim is None and t.hidden_size % t.num_attention_heads:
        raise ValueError(f"model.tiny.hidden_size={t.hidden_size} is not a multiple of model.tiny.num_attention_heads="
                         f"{t.num_attention_heads}" + ("; set model.tiny.head_dim" if t.arch != "llama" else ""))
    if t.head_dim is not None and (int(t.head_dim) < 2 or int(t.head_dim) % 2):
        raise ValueError(f"model.tiny.head_dim={t.head_dim!r}; allowed: an even int >= 2 (rotary embeddings rotate "
                         f"pairs), or null (hidden_size / num_attention_heads)")
    if t.arch == "qwen3_moe" and t.num_experts_per_tok > t.num_experts:
        raise ValueError(f"model.tiny.num_experts_per_tok={t.num_experts_per_tok} > model.tiny.num_experts="
                         f"{t.num_experts}; allowed: 1..num_experts (experts routed per token)")
    if not t.initializer_range > 0:
        raise ValueError(f"model.tiny.initializer_range={t.initializer_range!r}; allowed: a number > 0")


def validate(cfg: RunConfig) -> RunConfig:
    """Ranges and choices that the types cannot say; returns cfg."""
    m, t = cfg.method, cfg.train
    M.load_plugins(cfg.plugins)
    method = M.get_method(m.name)
    CC.check_numbers(cfg)
    CC.check_data_source(cfg)
    _choice("method.teacher", m.teacher, TEACHERS)
    _choice("train.schedule", t.schedule, SCHEDULES)
    _choice("train.precision", t.precision, PRECISIONS)
    _choice("train.optimizer", t.optimizer, OPTIMIZERS)
    _choice("train.zero_stage", t.zero_stage, (0, 1, 2, 3))
    _choice("train.device", t.device, ("auto", "cpu", "cuda"))
    for fld in ("weight_cache", "lowbit_batch"):
        if not isinstance(getattr(t, fld), bool):
            raise ValueError(f"train.{fld}={getattr(t, fld)!r}; allowed: true or false")
    _choice("train.weight_cache_batch", t.weight_cache_batch, WEIGHT_CACHE_BATCH)
    _choice("train.nvfp4_kernel", t.nvfp4_kernel, NVFP4_KERNELS)
    trackers.check(t.report_to)
    if t.grad_accum_dtype is not None:
        _choice("train.grad_accum_dtype", t.grad_accum_dtype, ("fp32",))
        if t.precision != "bf16" or t.zero_stage < 1:
            raise ValueError(f"train.grad_accum_dtype=fp32 with train.precision={t.precision!r}, "
                             f"train.zero_stage={t.zero_stage}; allowed: precision=bf16 and zero_stage >= 1 "
                             f"(DeepSpeed's BF16_Optimizer)")
    if t.lean_act and t.zero_stage == 3:
        raise ValueError("train.lean_act=true with train.zero_stage=3: the recompute in the backward runs outside "
                         "the module call, where ZeRO-3 has not gathered the norm's weight; use zero_stage <= 2")
    if t.immediate_grad_update and t.grad_accum_dtype is None:
        raise ValueError("train.immediate_grad_update=true needs train.grad_accum_dtype=fp32 (it folds bf16 "
                         "gradients into the fp32 accumulator of DeepSpeed's BF16_Optimizer)")
    _choice("model.dtype", cfg.model.dtype, MODEL_DTYPES)
    _choice("export.engine", cfg.export.engine, ("vllm", "sglang", "llama_cpp"))
    for fld in ("max_steps", "micro_batch", "grad_accum", "keep_last", "log_every"):
        if int(getattr(t, fld)) < 1:
            raise ValueError(f"train.{fld}={getattr(t, fld)!r}; allowed: an int >= 1")
    for fld in ("eval_every", "eval_samples", "save_every", "warmup_steps"):
        if int(getattr(t, fld)) < 0:
            raise ValueError(f"train.{fld}={getattr(t, fld)!r}; allowed: an int >= 0")
    if not t.lr > 0:
        raise ValueError(f"train.lr={t.lr!r}; allowed: a number > 0")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ValueError(f"train.min_lr_ratio={t.min_lr_ratio!r}; allowed: 0..1")
    if len(t.betas) != 2:
        raise ValueError(f"train.betas={list(t.betas)!r}; allowed: two numbers")
    if m.topk < 1:
        raise ValueError(f"method.topk={m.topk!r}; allowed: an int >= 1")
    method.validate(cfg)
    if cfg.data.doc_mask and method.needs.rollouts:
        raise ValueError(f"data.doc_mask=true with method={m.name}: its samples are prompts it completes, not packed "
                         f"documents; allowed: false")
    CC.check_sequence_parallel(cfg, method, type(method).loss is M.Method.loss)
    if m.loss.kind == "topk_kl" and m.teacher == "cached":
        check_topk(m.loss, 0, cached=True)
    if cfg.model.path is None and cfg.model.asset is None:
        if cfg.model.name not in TINY_NAMES:
            raise ValueError(f"model.path is null for model.name={cfg.model.name!r}; give a local model directory "
                             f"(model.path=/path/to/hf_dir), or a random model: model={list(TINY_NAMES)}")
        check_tiny(cfg.model.tiny, TINY_NAMES[cfg.model.name], cfg.model.name)
        if m.loss.kind == "topk_kl":
            check_topk(m.loss, int(cfg.model.tiny.vocab_size))
        if cfg.model.tokenizer is None and cfg.model.tiny.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(f"model.tiny.vocab_size={cfg.model.tiny.vocab_size}, smaller than the byte tokenizer's "
                             f"{ByteTokenizer.vocab_size} tokens; allowed: >= {ByteTokenizer.vocab_size} (its ids "
                             f"would index past the embedding)")
    if not 0.0 <= float(t.quant_start) <= 1.0:
        raise ValueError(f"train.quant_start={t.quant_start!r}; allowed: a fraction of max_steps in 0..1 "
                         f"(0.9: 90% full precision, then QAT)")
    if t.quant_lr is not None and not t.quant_lr > 0:
        raise ValueError(f"train.quant_lr={t.quant_lr!r}; allowed: a number > 0, or null (= train.lr)")
    quant_start.check(cfg, method)
    if not method.needs.native_base:     # a native base's own format is known only once it is read
        CC.check_export(cfg, NO_QUANT)
    if cfg.quant.weight_format not in NO_QUANT:
        cfg.quant.validate()
    elif cfg.quant.kv_format is not None:   # the KV emulation lives on a prepared student
        raise ValueError(f"quant.kv_format={cfg.quant.kv_format!r} with format=bf16: the KV-cache emulation is part of a "
                         f"quantized student (its exports carry the k/v scales); pick a weight format recipe")
    object.__setattr__(cfg, "_validated_as", _fingerprint(cfg))
    return cfg


def _fingerprint(cfg: RunConfig) -> str:
    return json.dumps(to_dict(cfg), sort_keys=True, default=str)


def is_validated(cfg: RunConfig) -> bool:
    """Whether :func:`validate` passed this config as it is now (a value changed since is checked again)."""
    return getattr(cfg, "_validated_as", None) == _fingerprint(cfg)


_STORED = False


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore (once)."""
    global _STORED
    if _STORED:
        return
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    _STORED = True


def _override_message(e: BaseException) -> str:
    """One line from Hydra's / OmegaConf's multi-line errors: the override, what is wrong, what is allowed."""
    msg = str(e)
    cause = e.__cause__ or e.__context__
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    head = lines[0] if lines else type(e).__name__
    m = re.search(r"Could not find '([^']+)'", msg)
    if m:
        opts = [ln.strip() for ln in msg.split("Available options", 1)[-1].splitlines()[1:]
                if ln.startswith("\t") and "provider=" not in ln and ln.strip()]
        group, _, name = m.group(1).rpartition("/")
        if group == "method":
            return (f"method={name}: no such method; registered: {M.method_names()} (a method outside the package: "
                    f"plugins=[your.module] imports the module that registers it)")
        return f"{group}={name}: no such recipe; allowed: {opts}" if opts else head
    text = head
    key = None
    if cause is not None and str(cause).strip():
        c = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
        key = next((ln.split(":", 1)[1].strip() for ln in c if ln.startswith("full_key:")), None)
        detail = c[0]
        text = head if detail in head else (detail if head in detail else f"{head}: {detail}")
        text += f" (field {key})" if key and key not in text else ""
    m = re.search(r"method\.([A-Za-z_]\w*)\.", f"{key or ''} {msg}")
    if m and m.group(1) not in ("loss", "options"):
        allowed = method_options(m.group(1))
        if allowed:
            text += f"; allowed: {allowed}"
    return text


def _plugin_recipes(overrides: List[str]) -> List[str]:
    """Import the ``plugins=[...]`` of the command line, then make each registered method without a
    recipe file selectable as ``method=<name>`` through its Method.recipe (Hydra's ConfigStore)."""
    mods: List[str] = []
    for o in OverridesParser.create().parse_overrides([x for x in overrides if x.lstrip("+~").startswith("plugins=")]):
        v = o.value()
        mods += [str(x) for x in (v if isinstance(v, list) else [v])]
    M.load_plugins(mods)
    files = {p.stem for p in (recipes_dir() / "method").glob("*.yaml")}
    cs = ConfigStore.instance()
    for name, cls in M.REGISTRY.items():
        if name not in files:
            cs.store(group="method", name=name, package="_global_",
                     node=cls.recipe if cls.recipe is not None else {"method": {"name": name}})
    # the schema of this run's methods (the plugins it names included)
    cs.store(name="run_schema", node=run_schema(mods))
    return mods


def compose(overrides: Optional[List[str]] = None, config_name: str = "config", check_files: bool = True) -> RunConfig:
    """Compose recipes/ with command-line style overrides into a validated RunConfig. A bad override
    or value raises exitcodes.UsageError with one line naming the field and what is allowed.
    ``data.train=[...]`` without a data group selects ``data=files``. ``check_files`` (a run's
    composition): the model and data paths exist, and a trained model never falls back to random
    tokens (compose_checks.check_inputs); off only to compare configs that never run."""
    register_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        plugins = _plugin_recipes(list(overrides or []))
        # data.train=[...] selects your files; whether random tokens were asked for by name
        overrides, asked_synthetic = CC.data_selection(list(overrides or []))
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
            node = hcompose(config_name=config_name, overrides=overrides)
        schema = OmegaConf.structured(run_schema(plugins))
        OmegaConf.set_struct(schema, True)      # a key the schema does not have is an error, not ignored
        OmegaConf.set_struct(schema.method.options, False)   # a plugin's options: checked by its own schema
        node = OmegaConf.merge(schema, OmegaConf.create(OmegaConf.to_container(node, resolve=True)))
        cfg = validate(OmegaConf.to_object(node))
        if check_files:
            CC.check_inputs(cfg, M.get_method(cfg.method.name), asked_synthetic)
        return cfg
    except (HydraException, OmegaConfBaseException) as e:
        raise UsageError(_override_message(e)) from None
    except (UsageError, BadInputError):
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None


def to_dict(cfg: RunConfig) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def _recipe_values(groups: List[str]) -> Dict[str, Any]:
    """The flat {dotted key: value} that recipe picks such as ``format=q4_k`` give (before any
    key=value; a mandatory value still unset reads as ``???``)."""
    register_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    _plugin_recipes(list(groups))
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        node = hcompose(config_name="config", overrides=list(groups))
    return _flat(OmegaConf.to_container(node, resolve=True, throw_on_missing=False))


def _flat(d: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(d, dict) and d:
        out: Dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


_PLAIN = re.compile(r"[A-Za-z0-9_./+:@~-]+")


def _value(v: Any) -> str:
    """``v`` as Hydra's override grammar reads it back (the same type and value)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_value(x)}" for k, x in v.items()) + "}"
    v = str(v)
    plain = _PLAIN.fullmatch(v) and v.lower() not in ("null", "true", "false", "nan", "inf", "-inf", "+inf")
    try:
        float(v)
        plain = False
    except ValueError:
        pass
    return v if plain else "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


def to_overrides(cfg: RunConfig, groups: List[str]) -> List[str]:
    """The key=value overrides that, after the recipe picks ``groups``, give ``cfg``:
    ``compose(groups + to_overrides(cfg, groups))`` is cfg again (the command line of a run built
    as an object, e.g. the demo's)."""
    base, now = _recipe_values(groups), _flat(to_dict(cfg))
    out = []
    for k, v in now.items():
        if k in base and base[k] == v and type(base[k]) is type(v):
            continue
        out.append(f"{'' if k in base else '+'}{k}={_value(v)}")
    return out


def from_dict(d: Dict[str, Any]) -> RunConfig:
    node = OmegaConf.merge(OmegaConf.structured(run_schema(d.get("plugins"))), OmegaConf.create(d))
    return validate(OmegaConf.to_object(node))
