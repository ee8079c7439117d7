"""Exporters: checkpoints that vLLM, SGLang and llama.cpp load as they are, and the parity gate.

    from qatfactory.exporters import export, verify
    res = export(converted, "out/nvfp4-vllm", engine="vllm", flavour="modelopt")
    report = verify("out/nvfp4-vllm", converted)   # bytes, weights and logits vs the student

Exporters take a :class:`qatfactory.formats.ConvertedModel` (plain data) and import nothing of
qatfactory but ``formats``.
"""
from . import llama_cpp, sglang, vllm  # noqa: F401,E402  (registration)
from .base import EXPORTERS, ExportError, ExportResult, export, list_exporters, read_record  # noqa: F401
from .verify import VerifyResult, verify  # noqa: F401,E402
