"""method=dapo: DAPO (clip-higher, token-level normalization, dynamic sampling) on GRPO's loop."""
from .grpo import GRPO


class DAPO(GRPO):
    name = "dapo"
    summary = "DAPO: GRPO's loop with clip-higher, token-level loss normalization and dynamic sampling"
