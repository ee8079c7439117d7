"""prepare / calibrate / convert / coverage for Hugging Face causal LMs (dense and MoE).

    cfg = QuantConfig.preset("nvfp4_w4a4", scale_strategy="frozen")
    model = prepare(model, cfg)            # nn.Linear -> QuantLinear, 3-D experts -> QuantExperts
    calibrate(model, batches, "mse")       # PTQ: frozen block scales + static activation amax
    register_zero3_external_params(model)  # only under DeepSpeed ZeRO-3
    ...train...                            # save_student / load_student for the parity gate and resume
    cm = convert(model)                    # ConvertedModel: packed tensors by on-disk HF name
    print(coverage(model).table())

Scale strategies: ``dynamic`` (block and per-tensor scales recomputed from the weights every
forward), ``frozen`` (calibrated, kept as buffers), ``learnable`` (LSQ step sizes, rounded onto the
format's E4M3/E8M0 grid each forward). Calibration methods ``mse``/``four_over_six`` need frozen or
learnable scales. Convert and calibrate expect whole (not ZeRO-partitioned) parameters.

The promise kept here: the prepared model's forward equals, with atol=0, the forward of a
model rebuilt from ``convert(model)``'s dequantized tensors.

The package: config (QuantConfig, presets), modules (what a model holds), prepare, search
(block-scale search; its numerics are formats/scale_search.py), calibrate, coverage, convert (+ the ZeRO-3
hook), io (save / load).
"""
from __future__ import annotations

from .calibrate import (  # noqa: F401
    _act_quantizers,
    _calibrate_kv,
    _imatrix_hook,
    calibrate,
    set_quantization,
)
from .config import (  # noqa: F401
    CALIB_METHODS,
    DEFAULT_EXCLUDE,
    NO_ACT,
    POLICY_TARGETS,
    SCALE_STRATEGIES,
    STE_MODES,
    LoRAConfig,
    ModuleRule,
    QuantConfig,
    _check_act_format,
    _check_choice,
    _check_pattern,
    _check_weight_format,
    match,
    presets,
)
from .convert import (  # noqa: F401
    _hf_tensors,
    _module_of,
    convert,
    disk_layout,
    register_zero3_external_params,
)
from .coverage import (  # noqa: F401
    CoverageReport,
    CoverageRow,
    _dtype_bits,
    coverage,
)
from .io import (  # noqa: F401
    QUANT_FILE,
    _student_state,
    _student_tied_keys,
    load_student,
    save_student,
)
from .modules import (  # noqa: F401
    _QUANT_MODULES,
    _QUANT_STATE_TYPES,
    FUSED_SIBLINGS,
    CoverageError,
    _embedding_name,
    _exclusion,
    _init_scale_state,
    _is_conv1d,
    _is_quant_site,
    _linear_like,
    _lm_head_name,
    _n_experts,
    _n_layers,
    _quant_embeddings,
    _quant_experts,
    _quant_linears,
    _resolve_format,
    _sites,
    _tied_lm_head,
    as_quant_config,
)
from .prepare import (  # noqa: F401
    _add_lora,
    _build_groups,
    _plan_embedding,
    _swap,
    _undo_prepare,
    prepare,
)
from .search import (  # noqa: F401
    search_scales,
)
