"""tokenizer.ggml.* for a GGUF file, decided from what the source tokenizer actually does.

llama.cpp tokenizes with its own code, steered by a few keys (src/llama-vocab.cpp, commit 0c1e570):

    tokenizer.ggml.model        "gpt2" (byte-level BPE) | "llama" (SentencePiece-style BPE, byte fallback)
    tokenizer.ggml.pre          the pre-tokenizer: which regex splits the text before BPE. A name
                                llama.cpp does not know is a load error; each name also carries
                                defaults ("llama-bpe" turns add_bos on, "smollm" keeps spaces).
    tokenizer.ggml.add_bos_token / add_eos_token
                                whether llama_tokenize(add_special=true) adds BOS / EOS. Absent,
                                the pre-tokenizer's default applies: the bug this file fixes was
                                "llama-bpe" with no add_bos, so llama.cpp put <|im_start|> in front
                                of every SmolLM2 prompt.
    tokenizer.ggml.add_space_prefix   SentencePiece-style: prepend "▁" (default true for "llama")
    token types                 1 normal, 2 unknown, 3 control (special added tokens, parsed only
                                with parse_special), 4 user-defined (other added tokens), 5 unused,
                                6 byte (<0xXX>)

Decisions:

* **BOS / EOS** from the tokenizer itself: ``AutoTokenizer`` (never remote code) encodes probe
  strings with and without ``add_special_tokens``; what it puts before / after the plain ids is
  what it adds. Without transformers' tokenizer, the same is read from tokenizer.json's
  TemplateProcessing post-processor.
* **Pre-tokenizer** from tokenizer.json's normalizer / pre_tokenizer, matched structurally to the
  llama.cpp pre-tokenizer that applies the same split (regexes as llama-vocab.cpp lists them):

      ByteLevel(use_regex=true) alone                  -> "gpt-2"   (GPT-2's regex)
      Digits(individual) + ByteLevel(use_regex=true)   -> "smollm"  (\\p{N}, then GPT-2's regex)
      Split(Llama-3 regex) + ByteLevel(use_regex=false)-> "llama-bpe"
      Split(Qwen2 regex)   + ByteLevel(use_regex=false)-> "qwen2"   (Qwen2, 2.5, 3)
      Split(Qwen3.5 regex) + ByteLevel(use_regex=false)-> "qwen35"

  (llama.cpp's own converter identifies tokenizers by hashing their output on a probe text;
  tests/exporters/test_gguf_tokenizer.py checks that it names the same pre-tokenizer for SmolLM2.) Anything
  else gets the architecture's usual name and ``pre_guess`` in the record, and the parity gate's
  llama.cpp tokenization check (exporters/gguf_tokenizer.py) says whether it holds.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from qatfactory._inputs import TOKENIZER_MAX_BYTES, read_json

from .base import ExportError

# the pre-tokenizer regexes of the tokenizer families (as their tokenizer.json files spell them)
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_NAMES = {_LLAMA3_RE: "llama-bpe", _QWEN2_RE: "qwen2", _QWEN35_RE: "qwen35"}
PROBES = ("Hello world", " leading space", "2024", "a\nb")


def _pre_list(pt) -> List[Dict[str, Any]]:
    if not isinstance(pt, dict):
        return []
    if pt.get("type") == "Sequence":
        return [p for p in pt.get("pretokenizers", []) if isinstance(p, dict)]
    return [pt]


def _split_regex(p: Dict[str, Any]) -> Optional[str]:
    pat = p.get("pattern")
    if isinstance(pat, dict):
        return pat.get("Regex")
    return None


def pre_tokenizer_name(tok: Dict[str, Any]) -> Optional[str]:
    """llama.cpp pre-tokenizer that splits text as this tokenizer.json does, or None if unknown."""
    parts = _pre_list(tok.get("pre_tokenizer"))
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True) and \
            parts[0].get("behavior") == "Isolated" and not parts[0].get("invert"):
        return _SPLIT_NAMES.get(_split_regex(parts[0]) or "")
    return None


def _added_by_template(tok: Dict[str, Any], vocab: Dict[str, int]) -> Tuple[List[int], List[int]]:
    """(ids before $A, ids after $A) in tokenizer.json's TemplateProcessing for a single sequence."""
    pp = tok.get("post_processor")
    procs = pp.get("processors", []) if isinstance(pp, dict) and pp.get("type") == "Sequence" else [pp]
    for p in procs:
        if not isinstance(p, dict) or p.get("type") != "TemplateProcessing":
            continue
        before, after, seen_a = [], [], False
        for item in p.get("single", []):
            if "Sequence" in item:
                seen_a = True
            elif "SpecialToken" in item:
                name = item["SpecialToken"]["id"]
                ids = (p.get("special_tokens", {}).get(name) or {}).get("ids") or \
                    ([vocab[name]] if name in vocab else [])
                (after if seen_a else before).extend(int(i) for i in ids)
        return before, after
    return [], []


def _probe_special(src: Path) -> Optional[Dict[str, Any]]:
    """What transformers' tokenizer adds around plain text: {"before": [...], "after": [...], ids}."""
    try:
        from transformers import AutoTokenizer  # noqa: PLC0415 (heavy: transformers)
        tk = AutoTokenizer.from_pretrained(str(src), trust_remote_code=False)
    except Exception as e:   # no usable transformers tokenizer: the caller reads tokenizer.json
        return {"error": f"{type(e).__name__}: {e}"}
    found = None
    for text in PROBES:
        plain = list(tk(text, add_special_tokens=False)["input_ids"])
        full = list(tk(text, add_special_tokens=True)["input_ids"])
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
        if at is None:
            return {"error": f"add_special_tokens changes the ids of {text!r} itself: {plain} -> {full}"}
        got = (full[:at], full[at + len(plain):])
        if found is not None and got != found:
            return {"error": f"the special tokens added depend on the text: {found} vs {got}"}
        found = got
    ids = {k: getattr(tk, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")}
    return {"before": found[0], "after": found[1], "ids": {k: v for k, v in ids.items() if isinstance(v, int)}}


def write_tokenizer_kv(writer, source_dir: Optional[str], cfg: Dict[str, Any], arch_pre: str, vocab_size: int,
                       tokenizer_pre: Optional[str]) -> Dict[str, Any]:
    """Write tokenizer.ggml.* from the HF tokenizer in source_dir; returns what was written and why."""
    src = Path(source_dir) if source_dir else None
    tj = src / "tokenizer.json" if src else None
    if tj is None or not tj.is_file():
        if src is not None and (src / "tokenizer.model").is_file():
            raise ExportError(f"{src}: only a SentencePiece tokenizer.model is present; write a tokenizer.json "
                              f"(AutoTokenizer.from_pretrained(dir).save_pretrained(dir)) so the vocabulary can be "
                              f"transcribed without sentencepiece")
        # no tokenizer: llama.cpp accepts a vocabulary-less model and uses <arch>.vocab_size
        writer.add_tokenizer_model("none")
        return {"model": "none", "reason": "no tokenizer.json in source_dir"}
    tok = read_json(tj, max_bytes=TOKENIZER_MAX_BYTES, want=dict)
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise NotImplementedError(f"{tj}: tokenizer model type {model.get('type')!r}; the GGUF exporter writes "
                                  f"BPE vocabularies (byte-level 'gpt2' or byte-fallback 'llama')")
    vocab: Dict[str, int] = dict(model["vocab"])
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    for content, a in added.items():
        vocab[content] = a["id"]
    if max(vocab.values()) + 1 > vocab_size:
        # llama.cpp sizes token_embd/output by the token list and refuses the file on a mismatch
        raise ExportError(f"{tj}: the tokenizer has ids up to {max(vocab.values())} but the model's vocab_size is "
                          f"{vocab_size}; llama.cpp would reject token_embd's shape. Export with the tokenizer that "
                          f"belongs to this model (or resize the embeddings to cover it)")
    n = vocab_size
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # unused
    for t, i in vocab.items():
        tokens[i] = t
        a = added.get(t)
        types[i] = 1 if a is None else (3 if a.get("special") else 4)
    merges = [" ".join(m) if isinstance(m, (list, tuple)) else m for m in model.get("merges", [])]
    byte_level = "ByteLevel" in json.dumps(tok.get("pre_tokenizer")) or "ByteLevel" in json.dumps(tok.get("decoder"))
    info: Dict[str, Any] = {}
    if byte_level:
        writer.add_tokenizer_model("gpt2")
        if tokenizer_pre:
            pre, how = tokenizer_pre, "given (tokenizer_pre=)"
        else:
            pre = pre_tokenizer_name(tok)
            how = "matched from tokenizer.json's pre_tokenizer"
            if pre is None:
                pre = arch_pre
                info["pre_guess"] = (f"pre_tokenizer {json.dumps(tok.get('pre_tokenizer'))[:200]} is not one llama.cpp "
                                     f"has a name for here; wrote the architecture's usual {arch_pre!r}, the closest; "
                                     f"the gate's llama.cpp tokenizer check decides whether it holds")
                how = "guessed (unrecognised pre_tokenizer)"
        writer.add_tokenizer_pre(pre)
        writer.add_token_merges(merges)
        kind = "gpt2"
        info["pre"], info["pre_source"] = pre, how
        space_prefix = False
    else:
        if not model.get("byte_fallback"):
            raise NotImplementedError(f"{tj}: a BPE tokenizer without byte-level pre-tokenization or byte fallback "
                                      f"has no llama.cpp tokenizer model")
        writer.add_tokenizer_model("llama")
        # SentencePiece-BPE merges by score: earlier ids were merged first in the HF export
        writer.add_token_scores([-float(i) for i in range(n)])
        for i, t in enumerate(tokens):
            if re.fullmatch(r"<0x[0-9A-F]{2}>", t):
                types[i] = 6
        unk = model.get("unk_token")
        if unk in vocab:
            types[vocab[unk]] = 2
        kind = "llama"
        norm, pt = json.dumps(tok.get("normalizer")), tok.get("pre_tokenizer") or {}
        space_prefix = '"Prepend"' in norm or (pt.get("type") == "Metaspace" and
                                               pt.get("prepend_scheme", "always") != "never")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_add_space_prefix(bool(space_prefix))
    tcfg = {}
    if (src / "tokenizer_config.json").is_file():
        tcfg = read_json(src / "tokenizer_config.json", max_bytes=TOKENIZER_MAX_BYTES, want=dict)

    # ---- special tokens and what encode() adds, from the tokenizer's behaviour
    probe = _probe_special(src)
    if "error" not in probe:
        before, after, ids = probe["before"], probe["after"], dict(probe["ids"])
        info["special_source"] = "probe: AutoTokenizer encode with / without add_special_tokens"
    else:
        before, after = _added_by_template(tok, vocab)
        ids = {}
        info["special_source"] = f"tokenizer.json post_processor (AutoTokenizer unusable: {probe['error'][:160]})"

    def cfg_id(key, cfg_key):  # noqa: E306
        t = tcfg.get(f"{key}_token")
        if isinstance(t, dict):
            t = t.get("content")
        if isinstance(t, str) and t in vocab:
            return vocab[t]
        v = cfg.get(cfg_key) if cfg_key else None
        return v if isinstance(v, int) else None

    for key, cfg_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "pad_token_id"), ("unk", None)):
        if key not in ids:
            i = cfg_id(key, cfg_key)
            if i is not None:
                ids[key] = int(i)
    add_bos = bool(before) and before == [ids.get("bos")]
    add_eos = bool(after) and after == [ids.get("eos")]
    if (before and not add_bos) or (after and not add_eos):
        info["special_unrepresentable"] = (f"encode() adds {before} before and {after} after the text, which "
                                           f"add_bos/add_eos (bos={ids.get('bos')}, eos={ids.get('eos')}) cannot "
                                           f"express; llama.cpp will not add them")
    for key, fn in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                    ("pad", writer.add_pad_token_id), ("unk", writer.add_unk_token_id)):
        if key in ids:
            fn(int(ids[key]))
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    tmpl = tcfg.get("chat_template")
    if tmpl is None and (src / "chat_template.jinja").is_file():
        tmpl = (src / "chat_template.jinja").read_text()
    named = []
    extra_dir = src / "additional_chat_templates"
    if isinstance(tmpl, str) and extra_dir.is_dir() and not extra_dir.is_symlink():
        # transformers loads these beside the default as named templates; llama.cpp reads them as
        # tokenizer.chat_template.<name>
        for p in sorted(extra_dir.glob("*.jinja")):
            if p.is_file() and not p.is_symlink():
                named.append({"name": p.stem, "template": p.read_text(encoding="utf-8")})
    if isinstance(tmpl, str):
        writer.add_chat_template([{"name": "default", "template": tmpl}] + named if named else tmpl)
    return {"model": kind, "tokens": n, "merges": len(merges), "add_bos": add_bos, "add_eos": add_eos,
            "add_space_prefix": bool(space_prefix), "chat_template": isinstance(tmpl, str),
            **({"named_chat_templates": [t["name"] for t in named]} if named else {}),
            **{f"{k}_token": v for k, v in ids.items()}, **info}
