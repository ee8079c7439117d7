"""method=scale_adapter: train the block scales of a native NVFP4 / MXFP4 checkpoint (Scale-QLoRA);
its loop is train/scale_loop.py (the base's codes stay frozen, the export writes new scale bytes)."""
from ...nn.scale_adapter import ScaleAdapterConfig
from .base import Method, Needs


def _scale_loop(cfg, eval_only):
    from ..scale_loop import run  # noqa: PLC0415 (cycle: scale_loop imports the trainer, which imports this registry)
    return run(cfg, eval_only)


class ScaleAdapter(Method):
    name = "scale_adapter"
    summary = "scale-only adapters on a native 4-bit checkpoint: codes frozen, block scales trained"
    needs = Needs(native_base=True)
    options, options_key = ScaleAdapterConfig, "scale"
    quant_start_refusal = "method=scale_adapter trains the scales of a native 4-bit base"
    own_loop = staticmethod(_scale_loop)

    def validate(self, cfg) -> None:
        super().validate(cfg)
        cfg.method.scale.validate()
