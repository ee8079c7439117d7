"""Does llama.cpp tokenize a GGUF's prompts as the Hugging Face tokenizer does? Ask llama.cpp.

The oracle is llama.cpp's own tokenizer (llama-cpp-python's ``Llama(vocab_only=True).tokenize``,
i.e. ``llama_tokenize`` from the built libllama), run in a subprocess (its libggml must not meet
libggml-python's, same soname, other ABI). The reference is ``transformers.AutoTokenizer`` on the
source model's tokenizer files (never remote code). Nothing here reads our GGUF writer's code or
decisions: the two tokenizers meet only through the file.

Each probe string is tokenized both ways with special tokens added (HF ``add_special_tokens=True``
vs llama.cpp ``add_special=True``: BOS / EOS behaviour) and without, special tokens parsed in the
text (HF always splits its added tokens out; llama.cpp does with ``parse_special=True``). The
probes: plain text, a leading space, digits, unicode and emoji, newlines / tabs / runs of spaces,
contractions, the empty string, and -- when the tokenizer has a chat template -- the template
rendered for a system + user message with the generation prompt.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import gguf

PROBES = [
    "The quick brown fox jumps over the lazy dog.",
    " Hello world",
    "  two leading spaces",
    "In 2024 the price rose 3.14159% to 1234567890.",
    "Café naïve — 日本語のテキスト, emoji 😀🦙 and Ünïcödé",
    "line one\nline two\n\n    indented\tand\ttabs   spaced  out\n",
    "I've been 'told he's there, 'RE you sure? We'Ve a'lL",
    "",
]
CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the boiling point of water at sea level?"}]

_RUNNER = r"""
import json, sys
from llama_cpp import Llama
path, strings_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
strings = json.load(open(strings_file, encoding="utf-8"))
llm = Llama(model_path=path, vocab_only=True, verbose=False)
res = {"with_special": [llm.tokenize(s.encode("utf-8"), add_bos=True, special=True) for s in strings],
       "plain": [llm.tokenize(s.encode("utf-8"), add_bos=False, special=True) for s in strings],
       "bos": llm.token_bos(), "eos": llm.token_eos(), "n_vocab": llm.n_vocab()}
json.dump(res, open(out, "w"))
"""


@dataclass
class TokenizerParity:
    status: str                       # "ok" | "FAIL" | "unavailable" (llama.cpp or the HF tokenizer missing)
    detail: str
    strings: int = 0
    mismatches: List[Dict[str, Any]] = field(default_factory=list)


def probe_strings(tokenizer) -> List[str]:
    """PROBES, plus the chat template rendered for a system + user message when there is one."""
    out = list(PROBES)
    if getattr(tokenizer, "chat_template", None):
        out.append(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    return out


def llama_cpp_tokenize(gguf_path, strings: List[str], timeout: float = 300) -> Dict[str, Any]:
    """llama.cpp's token ids for ``strings`` (with and without special tokens added), its BOS / EOS."""
    with tempfile.TemporaryDirectory(prefix="qf-tok-") as td:
        sf, out = os.path.join(td, "strings.json"), os.path.join(td, "ids.json")
        with open(sf, "w", encoding="utf-8") as f:
            json.dump(strings, f, ensure_ascii=False)
        r = subprocess.run([sys.executable, "-c", _RUNNER, str(gguf_path), sf, out], capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
            raise RuntimeError(f"llama.cpp could not load the vocabulary of {gguf_path}: {tail}")
        with open(out) as f:
            return json.load(f)


def tokenizer_parity(gguf_path, tokenizer_dir, strings: Optional[List[str]] = None) -> TokenizerParity:
    """Compare llama.cpp's tokenization of the GGUF with transformers' of ``tokenizer_dir``."""
    if importlib.util.find_spec("llama_cpp") is None:
        return TokenizerParity("unavailable", "llama-cpp-python is not installed (scripts/llama_cpp_runtime.py "
                                              "ensure builds llama.cpp's runtime and links it into the venv)")
    try:
        from transformers import AutoTokenizer  # noqa: PLC0415 (heavy: transformers)
        hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    except Exception as e:
        return TokenizerParity("unavailable", f"no Hugging Face tokenizer loads from {tokenizer_dir}: "
                                              f"{type(e).__name__}: {str(e)[:200]}")
    strings = probe_strings(hf) if strings is None else list(strings)
    try:
        got = llama_cpp_tokenize(gguf_path, strings)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return TokenizerParity("FAIL", str(e)[:300], len(strings))
    bad = []
    for i, s in enumerate(strings):
        for mode, add in (("with_special", True), ("plain", False)):
            want = list(hf(s, add_special_tokens=add)["input_ids"])
            have = list(got[mode][i])
            if want != have:
                k = next((j for j in range(min(len(want), len(have))) if want[j] != have[j]),
                         min(len(want), len(have)))
                bad.append({"string": s[:80], "mode": mode, "hf": want[max(0, k - 2):k + 6],
                            "llama_cpp": have[max(0, k - 2):k + 6], "at": k, "len": (len(want), len(have))})
    if bad:
        b = bad[0]
        return TokenizerParity("FAIL", f"{len(bad)} of {2 * len(strings)} tokenizations differ; first: {b['string']!r} "
                                       f"({b['mode']}) at token {b['at']}: HF {b['hf']} vs llama.cpp "
                                       f"{b['llama_cpp']}", len(strings), bad)
    return TokenizerParity("ok", f"{len(strings)} strings x (special tokens added / not) give identical ids"
                                 f"{' incl. the chat template' if len(strings) > len(PROBES) else ''}; "
                                 f"BOS {got['bos']} EOS {got['eos']}", len(strings))


def gate_check(res, gguf_path: Path, tokenizer_dir, run: bool) -> None:
    """The parity gate's tokenizer row for a GGUF export (exporters/verify/gguf.py calls this once).
    ``run=False`` is the user's opt-out (llama_cpp=False): the row is then INCOMPLETE, never ok."""
    check = "llama.cpp tokenization == transformers"
    if not run:
        res.opted_out("tokenizer", check, "llama_cpp=False")
        return
    src = Path(tokenizer_dir) if tokenizer_dir else None
    if src is None or not (src / "tokenizer.json").is_file():
        try:
            has_vocab = "tokenizer.ggml.tokens" in gguf.GGUFReader(str(gguf_path)).fields
        except Exception:
            has_vocab = True
        if has_vocab:
            res.add("tokenizer", check, "INCOMPLETE", f"not run: the GGUF has a vocabulary but {src} holds no "
                    "tokenizer.json to compare it with (pass the source model's directory)")
        else:
            res.add("tokenizer", check, "ok", "neither the source nor the GGUF has a vocabulary",
                    source="gguf.GGUFReader")
        return
    r = tokenizer_parity(gguf_path, src)
    if r.status == "unavailable":
        res.add("tokenizer", check, "INCOMPLETE", f"not run: {r.detail}",
                install="pip install llama-cpp-python (or: python scripts/llama_cpp_runtime.py ensure)")
        return
    res.add("tokenizer", check, r.status, r.detail, source="llama-cpp-python vs transformers")
