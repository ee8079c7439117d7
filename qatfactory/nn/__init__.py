"""Fake-quant modules: QuantLinear, QuantEmbedding, QuantExperts (fused 3-D MoE experts), LoRA, quantizers."""
from .embedding import QuantEmbedding, tie_head  # noqa: F401
from .experts import QuantExperts, QuantExpertsMixin, is_fused_experts, make_quant_experts  # noqa: F401
from .fake_quant import ActQuantizer, WeightQuantizer, decode_grid, encode_grid, scale_grid  # noqa: F401
from .linear import QuantLinear  # noqa: F401
from .lora import LoRA  # noqa: F401
