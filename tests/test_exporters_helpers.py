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
    """One tokenizer/base-model directory per test session, removed when the session ends (it was left in /tmp
    by every run before)."""
    if "src" not in _SRC:
        import atexit
        import shutil
        import tempfile
        d = Path(tempfile.mkdtemp(prefix="qf-export-src-"))
        atexit.register(shutil.rmtree, d, True)
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


# ------------------------------------------------------------------------------ Mixtral / tied / matrix cells
MIXTRAL = dict(H=256, INTER=64, LAYERS=2, EXPERTS=4, TOPK=2, VOCAB=128, HEADS=4, KV_HEADS=2)
TIED_VOCAB = 128


def mixtral_student(fmt: str, act=None, rules=(), preset=None, exclude=()) -> ConvertedModel:
    """A tiny random Mixtral (transformers MixtralForCausalLM) prepared/calibrated/converted with the
    real quantize API (cached: treat the result as read-only)."""
    key = ("mixtral", fmt, act, tuple(rules), preset, tuple(exclude))
    if key in _CACHE:
        return _CACHE[key]
    import transformers as T

    from qatfactory.quantize import DEFAULT_EXCLUDE, ModuleRule, QuantConfig, calibrate, convert, prepare

    m = MIXTRAL
    torch.manual_seed(0)
    cfg = T.MixtralConfig(vocab_size=m["VOCAB"], hidden_size=m["H"], intermediate_size=m["INTER"],
                          num_hidden_layers=m["LAYERS"], num_attention_heads=m["HEADS"],
                          num_key_value_heads=m["KV_HEADS"], num_local_experts=m["EXPERTS"],
                          num_experts_per_tok=m["TOPK"], max_position_embeddings=64, tie_word_embeddings=False)
    model = T.MixtralForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # std 0.02 gives flat logits and near-tied routing; spread them
        for n, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.06)
            if n.endswith(".gate.weight"):
                p.mul_(6)
    if preset:
        qc = QuantConfig.preset(preset)
    else:
        qc = QuantConfig(weight_format=fmt, act_format=act, rules=[ModuleRule(**dict(r)) for r in rules],
                         exclude=list(DEFAULT_EXCLUDE) + list(exclude))
    prepare(model, qc)
    if act:
        calibrate(model, [torch.randint(0, m["VOCAB"], (1, 16), generator=torch.Generator().manual_seed(0))])
    _CACHE[key] = convert(model)
    return _CACHE[key]


def tied_student(kind: str, fmt: str, act=None, preset=None, tie: bool = True, wide: bool = False) -> ConvertedModel:
    """Tiny random Llama/Qwen3 (hidden 128, 2 layers) with tied (or, tie=False, untied) embeddings,
    prepared/calibrated/converted with the real quantize API (cached: read-only). ``wide``: the preset
    keeps the embedding (and a tied head) in the model dtype (quantize_embeddings=False)."""
    key = ("tied", kind, fmt, act, preset, tie, wide)
    if key in _CACHE:
        return _CACHE[key]
    import transformers as T

    from qatfactory.quantize import QuantConfig, calibrate, convert, prepare

    torch.manual_seed(0)
    common = dict(vocab_size=TIED_VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tie)
    if kind == "llama":
        model = T.LlamaForCausalLM._from_config(T.LlamaConfig(**common), dtype=torch.bfloat16)
    else:
        model = T.Qwen3ForCausalLM._from_config(T.Qwen3Config(head_dim=64, **common), dtype=torch.bfloat16)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.06)
    qc = QuantConfig.preset(preset, **({"quantize_embeddings": False} if wide else {})) if preset \
        else QuantConfig(weight_format=fmt, act_format=act)
    prepare(model, qc)
    if act:
        calibrate(model, [torch.randint(0, TIED_VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))])
    _CACHE[key] = convert(model)
    return _CACHE[key]


GEMMA3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, max_position_embeddings=128,
              sliding_window=8, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def gemma3_model(seed: int = 0, **over):
    """A tiny random Gemma3ForCausalLM (gemma3_text: 2 sliding-window layers of window 8, tied, hidden 64) in
    bf16, with norm weights away from zero so that Gemma's (1 + w) convention shows in every check."""
    import transformers as T
    torch.manual_seed(seed)
    model = T.Gemma3ForCausalLM._from_config(T.Gemma3TextConfig(**dict(GEMMA3, **over)), dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.06)
            elif n.endswith("norm.weight"):
                p.normal_(0, 0.1)
    return model


def gemma3_student(fmt: str, act=None, rules=(), exclude=()) -> ConvertedModel:
    """gemma3_model prepared/calibrated/converted with the real quantize API (cached: read-only)."""
    key = ("gemma3", fmt, act, tuple(rules), tuple(exclude))
    if key in _CACHE:
        return _CACHE[key]
    from qatfactory.quantize import DEFAULT_EXCLUDE, ModuleRule, QuantConfig, calibrate, convert, prepare
    model = gemma3_model()
    prepare(model, QuantConfig(weight_format=fmt, act_format=act, rules=[ModuleRule(**dict(r)) for r in rules],
                               exclude=list(DEFAULT_EXCLUDE) + list(exclude)))
    if act:
        calibrate(model, [torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))])
    cm = convert(model)
    cm.source_dir = str(source_dir())
    _CACHE[key] = cm
    return cm


QWEN3_5 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
               num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=128, bos_token_id=1,
               eos_token_id=2, tie_word_embeddings=False)


def qwen3_5_model(seed: int = 0, **over):
    """A tiny random Qwen3.5 dense text model (qwen3_5_text, Qwen3_5ForCausalLM: three Gated DeltaNet layers then
    one gated full-attention layer, hidden 64) in bf16, norms away from zero."""
    import transformers as T
    torch.manual_seed(seed)
    model = T.Qwen3_5ForCausalLM._from_config(T.Qwen3_5TextConfig(**dict(QWEN3_5, **over)), dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.06)
            elif n.endswith("norm.weight"):
                p.normal_(0, 0.1)
    return model


def qwen3_5_student(fmt: str, act=None) -> ConvertedModel:
    """qwen3_5_model prepared/calibrated/converted with the real quantize API (cached: read-only)."""
    key = ("qwen3_5", fmt, act)
    if key in _CACHE:
        return _CACHE[key]
    from qatfactory.quantize import QuantConfig, calibrate, convert, prepare
    model = qwen3_5_model()
    prepare(model, QuantConfig(weight_format=fmt, act_format=act))
    if act:
        calibrate(model, [torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))])
    cm = convert(model)
    cm.source_dir = str(source_dir())
    _CACHE[key] = cm
    return cm


def cell_student(cell) -> ConvertedModel:
    """The student of a matrix cell (qatfactory.exporters.matrix.Cell)."""
    if cell.kind == "qwen3_5":
        return qwen3_5_student(cell.fmt, cell.act)
    if cell.kind == "gemma3":
        return gemma3_student(cell.fmt, cell.act, rules=cell.rules, exclude=cell.exclude)
    if cell.kind == "mixtral":
        return mixtral_student(cell.fmt, cell.act, rules=cell.rules, preset=cell.preset, exclude=cell.exclude)
    if cell.kind.endswith("_tied"):
        return tied_student(cell.kind[: -len("_tied")], cell.fmt, cell.act, preset=cell.preset)
    if cell.preset:
        raise ValueError(f"{cell.id}: presets are only wired for mixtral / tied students")
    return student(cell.kind, cell.fmt, cell.act, exclude=list(cell.exclude) or None,
                   rules=[dict(r) for r in cell.rules] or None)


def cells(pred):
    """Matrix cells matching ``pred``, as pytest params with their ids."""
    import pytest

    from qatfactory.exporters.matrix import CELLS
    return [pytest.param(c, id=c.id) for c in CELLS if pred(c)]
