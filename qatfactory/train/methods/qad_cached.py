"""method=qad_cached: QAD from a top-k teacher cache, written once by a precompute pass (the teacher
is then never loaded again; the cache is reused by every run on the same data)."""
from .base import Needs
from .qad import QAD


class QADCached(QAD):
    name = "qad_cached"
    summary = "QAD from a top-k teacher cache (method.topk, method.teacher_cache)"
    needs = Needs(teacher=("cached",))
