"""Tiny random students for the exporter tests (no tests in here).

``make_student`` builds a tiny transformers model from a config, runs the real
quantize.prepare / calibrate / convert on it and returns the ConvertedModel the exporters get.
``build_tokenizer`` trains a small byte-level BPE with the ``tokenizers`` library and saves it
as the base-model directory (tokenizer files, generation config).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import torch

from qatfactory.formats import ConvertedModel

VOCAB = 320
_TEXT = ["the quick brown fox jumps over the lazy dog", "quantization aware training ships the bytes it trained",
         "vLLM SGLang and llama.cpp load the export", "hello world, hello tokens 0123456789"] * 4


def tiny_config(kind: str) -> Dict:
    common = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=256, max_position_embeddings=128,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        return dict(model_type="llama", architectures=["LlamaForCausalLM"], **common)
    if kind == "qwen3":
        return dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=64, **common)
    if kind == "qwen2":  # q/k/v biases
        return dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], **dict(common, num_hidden_layers=1))
    if kind == "qwen3_moe":
        return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=64, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[], **common)
    raise ValueError(kind)


def build_tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TEXT, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 128}))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def make_student(kind: str, fmt: str, src: Optional[Path] = None, act: Optional[str] = None, seed: int = 0,
                 exclude=None, rules=None) -> ConvertedModel:
    """A tiny random model prepared with the real QuantConfig/prepare, calibrated when W4A4,
    and converted with the real quantize.convert (the exporters' actual input)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qatfactory.quantize import DEFAULT_EXCLUDE, ModuleRule, QuantConfig, calibrate, convert, prepare

    torch.manual_seed(seed)
    cfg = tiny_config(kind)
    mt = cfg.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **cfg), dtype=torch.bfloat16)
    with torch.no_grad():  # decisive values: the random init (std 0.02) gives near-flat logits and routing
        for n, prm in model.named_parameters():
            if prm.ndim >= 2:
                prm.normal_(0, 0.06)
            if n.endswith("mlp.gate.weight"):
                prm.mul_(6)
    qc = QuantConfig(weight_format=fmt, act_format=act, rules=[ModuleRule(**r) for r in (rules or [])],
                     exclude=list(DEFAULT_EXCLUDE) + list(exclude or []))
    prepare(model, qc)
    if act:
        g = torch.Generator().manual_seed(seed)
        calibrate(model, [torch.randint(0, VOCAB, (1, 16), generator=g)])
    cm = convert(model)
    cm.source_dir = str(src) if src is not None else None
    cm.recipe = {"test": f"tiny random {kind}", "format": fmt, "act": act}
    return cm


_CACHE: Dict[tuple, ConvertedModel] = {}
_SRC: Dict[str, Path] = {}


def source_dir() -> Path:
    """One tokenizer/base-model directory per test session."""
    if "src" not in _SRC:
        import tempfile
        d = Path(tempfile.mkdtemp(prefix="qf-export-src-"))
        build_tokenizer(d)
        (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
        _SRC["src"] = d
    return _SRC["src"]


def student(kind: str, fmt: str, act: Optional[str] = None, exclude=None, rules=None) -> ConvertedModel:
    """Cached make_student (students are shared by the exporter test files; copy before mutating)."""
    key = (kind, fmt, act, tuple(exclude or ()), tuple(tuple(sorted(r.items())) for r in (rules or [])))
    if key not in _CACHE:
        _CACHE[key] = make_student(kind, fmt, source_dir(), act=act, exclude=exclude, rules=rules)
    return _CACHE[key]
