"""Distillation: chunked losses (forward/reverse KL, JSD, CE and mixes) and teachers (live or top-k cache)."""
from .losses import (  # noqa: F401
    LOSS_KINDS,
    LiveTeacherOut,
    LossConfig,
    TopKTeacherOut,
    lm_loss,
    lm_metrics,
    naive_lm_loss,
)
from .teachers import (  # noqa: F401
    CachedTeacher,
    HiddenStates,
    LiveTeacher,
    head_weight,
    precompute_topk,
    split_causal_lm,
)

__all__ = ["LOSS_KINDS", "LiveTeacherOut", "LossConfig", "TopKTeacherOut", "lm_loss", "lm_metrics", "naive_lm_loss",
           "CachedTeacher", "HiddenStates", "LiveTeacher", "head_weight", "precompute_topk", "split_causal_lm"]
