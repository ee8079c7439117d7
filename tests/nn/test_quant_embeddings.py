"""Quantized token embeddings (QuantEmbedding) as llama.cpp stores and runs them.

llama.cpp's Q4_K_M keeps ``token_embd`` quantized (SmolLM2's tied 576-wide table: Q8_0) and, for a
tied model, multiplies the hidden states by that same tensor. The student must train on exactly
that: the lookup returns the dequantized rows, a tied head is the same quantized tensor, convert
hands the packed table to the GGUF exporter, and the safetensors engines refuse it."""
import pytest
import torch

from quant_helpers import DT, ids, rebuild, tiny
from qatfactory.exporters import ExportError, export, verify
from qatfactory.formats import get_format
from qatfactory.nn import QuantEmbedding, QuantLinear
from qatfactory.quantize import QuantConfig, calibrate, convert, coverage, load_student, prepare, save_student


def _logits(m, x):
    m.eval()
    with torch.no_grad():
        return m(input_ids=x).logits


@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q4_k", "q6_k", "mxfp4_ggml", "nvfp4_ggml"])
def test_lookup_of_gathered_rows_equals_rows_of_the_quantized_table(fmt):
    """The lookup quantizes only the rows it gathers: bit-identical to quantizing the whole table
    and gathering (each format quantizes rows independently), gradient straight through."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(64, 256, dtype=DT)
    with torch.no_grad():
        emb.weight.normal_(0, 0.05)
    q = QuantEmbedding(emb, fmt)
    x = torch.randint(0, 64, (3, 7))
    table = get_format(fmt).fake_quantize(emb.weight.detach().float()).to(DT)
    got = q(x)
    assert got.dtype == DT and torch.equal(got, table[x])
    assert not torch.equal(got, emb.weight.detach()[x])           # not a no-op
    got.float().pow(2).sum().backward()
    want = torch.zeros(64, 256, dtype=torch.float32)
    want.index_add_(0, x.reshape(-1), 2 * got.detach().float().reshape(-1, 256))
    torch.testing.assert_close(emb.weight.grad.float(), want, rtol=0.01, atol=1e-4)


@pytest.mark.parametrize("tie", [True, False])
def test_q4_k_preset_quantizes_the_table_as_llama_quantize(tmp_path, tie):
    m = tiny("llama", hidden=256, inter=96, tie_word_embeddings=tie)
    plain = _logits(m, ids())
    prepare(m, QuantConfig.preset("q4_k"))
    e, h = m.model.embed_tokens, m.lm_head
    assert isinstance(e, QuantEmbedding) and isinstance(h, QuantLinear)
    if tie:   # one tensor, one quantizer: llama.cpp multiplies by token_embd itself (256 % 256 == 0: q6_k)
        assert e.weight_format == h.weight_format == "q6_k"
        assert h.weight is e.weight and h.weight_quant is e.weight_quant and h.tied_to is e
    else:     # untied: token_embd takes the base type, output its own rule
        assert (e.weight_format, h.weight_format) == ("q4_k", "q6_k") and h.tied_to is None
    calibrate(m, [ids(seed=3)])
    x = ids()
    m.train()
    m(input_ids=x, labels=x).loss.backward()
    assert e.weight.grad is not None and bool(e.weight.grad.abs().sum() > 0)
    a = _logits(m, x)
    assert not torch.equal(a, plain)
    cm = convert(m)
    assert cm.packed["model.embed_tokens.weight"].format == e.weight_format
    assert ("lm_head.weight" in cm.packed) == (not tie) and "lm_head.weight" not in cm.dense
    # the promise: a plain transformers model rebuilt from the dequantized tensors gives the same logits
    torch.testing.assert_close(a, _logits(rebuild(cm, str(tmp_path / "r")), x), atol=0, rtol=0)
    rows = {r.name: r for r in coverage(m).rows}
    assert rows["model.embed_tokens.weight"].status == "quantized"
    assert rows["lm_head.weight"].status == ("tied" if tie else "quantized")
    assert coverage(m).totals["params"] == sum(p.numel() for p in m.parameters())
    # save / load keeps the sharing and the values
    save_student(m, str(tmp_path / "s"))
    r = load_student(str(tmp_path / "s"))
    assert (r.lm_head.weight_quant is r.model.embed_tokens.weight_quant) == tie
    torch.testing.assert_close(_logits(r, x), a, atol=0, rtol=0)


def test_the_gguf_holds_the_trained_table_and_the_safetensors_engines_refuse_it(tmp_path):
    import gguf
    m = tiny("llama", hidden=64, inter=128, tie_word_embeddings=True)
    prepare(m, QuantConfig.preset("q4_k"))
    cm = convert(m)
    export(cm, tmp_path / "g", engine="llama_cpp")
    t = {x.name: x for x in gguf.GGUFReader(str(tmp_path / "g" / "model.gguf")).tensors}
    assert t["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0 and "output.weight" not in t
    dec = gguf.quants.dequantize(t["token_embd.weight"].data, gguf.GGMLQuantizationType.Q8_0).reshape(128, 64)
    # gguf-py's decode (exact in f32) is what the bf16 student's lookup returns, rounded to its dtype
    assert torch.equal(torch.from_numpy(dec).to(DT), m.model.embed_tokens.quantized_weight().detach())
    assert torch.equal(torch.from_numpy(dec), get_format("q8_0").dequantize(cm.packed["model.embed_tokens.weight"]))
    v = verify(tmp_path / "g", cm)  # llama.cpp runtime and tokenizer included (in make test)
    assert v.verdict == "PASS", v.table()
    for engine, flavour in (("vllm", "modelopt"), ("vllm", "compressed-tensors"), ("sglang", "modelopt")):
        # the Q4_K_M student's other tensors are ggml types too: keeping the embeddings wide (the embedding
        # refusal's advice) would only lead to this refusal, so it comes first
        with pytest.raises(ExportError, match=r"cannot export format 'q\d_\w+': it is a llama.cpp/ggml format"):
            export(cm, tmp_path / f"{engine}-{flavour}", engine=engine, flavour=flavour)
        assert not (tmp_path / f"{engine}-{flavour}").exists()


def test_keeping_the_embeddings_wide_is_an_explicit_choice():
    m = tiny("llama", hidden=64, inter=128, tie_word_embeddings=True)
    prepare(m, QuantConfig.preset("q4_k", quantize_embeddings=False))
    assert type(m.model.embed_tokens) is torch.nn.Embedding and type(m.lm_head) is torch.nn.Linear
    cm = convert(m)
    assert cm.dense["model.embed_tokens.weight"].dtype == DT
    # the default for the other recipes: vLLM/SGLang keep embeddings in the model dtype
    assert QuantConfig.preset("nvfp4_w4a16").quantize_embeddings is False


def test_quantized_embedding_formats_are_llama_cpp_types(tmp_path):
    m = tiny("llama", hidden=64, inter=128)
    with pytest.raises(ValueError, match=r"quantize_embeddings: model.embed_tokens would be stored as 'nvfp4'.*"
                                         r"allowed: a rule giving 'model.embed_tokens' one of \[.*'q8_0'"):
        prepare(m, QuantConfig(weight_format="nvfp4", quantize_embeddings=True))
    assert type(m.model.embed_tokens) is torch.nn.Embedding        # left as it was
    from qatfactory.quantize import ModuleRule
    prepare(m, QuantConfig(weight_format="nvfp4", quantize_embeddings=True,
                           rules=[ModuleRule("model.embed_tokens", weight="q8_0")]))
    assert m.model.embed_tokens.weight_format == "q8_0"
    # every other tensor NVFP4: keeping the embedding wide is what the safetensors engines need, and the refusal says so
    with pytest.raises(ExportError, match=r"embed_tokens.weight is quantized \(q8_0\).*quantize_embeddings=False"):
        export(convert(m), tmp_path / "v", engine="vllm", flavour="compressed-tensors")
