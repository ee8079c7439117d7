"""The GGUF tokenizer keys, value by value, against the student's own tokenizer files.

llama.cpp serves whatever ``tokenizer.*`` says: the vocabulary it detokenizes with, the ids it stops
at (EOS/EOT), what it puts in front of a prompt, the chat template it renders. The tokenization row
(exporters/gguf_tokenizer.py) only sees what nine probe strings touch, so here every key llama.cpp
reads is compared by value with a reference read from the source tokenizer by third-party code:

    tokens, token types   transformers ``AutoTokenizer`` (get_vocab, added_tokens_decoder); ids the
                          tokenizer lacks are ``[PAD<i>]`` of type UNUSED, as llama.cpp's converter
                          writes them; added special tokens CONTROL, other added USER_DEFINED,
                          byte-fallback vocabularies: ``<0xXX>`` BYTE and the unknown token UNKNOWN
    merges                gguf-py's ``SpecialVocab(load_merges=True)`` (llama.cpp's converter reader)
    scores (SPM "llama")  llama.cpp's SPM tokenizer merges the best-scored pair first, so the score of
                          each merge's result must fall in tokenizer.json's merge order
    special ids           ``AutoTokenizer.<bos|eos|unk|pad|sep|cls|mask>_token_id``; bos/eos/pad fall
                          back to the student's config.json ids when the tokenizer names none
    add_bos / add_eos     what ``AutoTokenizer`` puts around plain text with add_special_tokens=True
    chat templates        ``AutoTokenizer.chat_template`` (a name -> template dict when the source has
                          additional_chat_templates/): tokenizer.chat_template and each
                          tokenizer.chat_template.<name>

Any other ``tokenizer.*`` key in the file (eot/eom/fim ids, a charsmap, an embedded tokenizer.json)
is a key nothing here vouches for: a FAIL naming it. Nothing of the exporter is imported.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from .result import FAIL, INCOMPLETE, OK, VerifyResult, need

# gguf-py's key names (gguf.constants.Keys.Tokenizer), spelled out so a renamed key is noticed here
K_MODEL, K_PRE, K_TOKENS = "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens"
K_TYPES, K_SCORES, K_MERGES = "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges"
K_PREFIX = "tokenizer.ggml.add_space_prefix"
K_TEMPLATE, K_TEMPLATES = "tokenizer.chat_template", "tokenizer.chat_templates"
SPECIAL_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id",
                "sep": "tokenizer.ggml.seperator_token_id", "cls": "tokenizer.ggml.cls_token_id",
                "mask": "tokenizer.ggml.mask_token_id"}
ADD_KEYS = {"bos": "tokenizer.ggml.add_bos_token", "eos": "tokenizer.ggml.add_eos_token",
            "sep": "tokenizer.ggml.add_sep_token"}
# decided from the source's pre-tokenizer / normalizer: proven by llama.cpp's own tokenization row
BEHAVIOURAL = (K_PRE, K_PREFIX)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
_PROBES = ("Hello world", " leading space", "2024", "a\nb")
ROW = "tokenizer"


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _first_diff(got: List[Any], want: List[Any]) -> Optional[int]:
    for i in range(min(len(got), len(want))):
        if got[i] != want[i]:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def _list_row(res: VerifyResult, key: str, what: str, got: Optional[List[Any]], want: List[Any], src: str) -> None:
    if got is None:
        res.add(ROW, f"{what} == source", FAIL, f"{key} missing (the source has {len(want)} entries)", source=src)
        return
    i = _first_diff(got, want)
    if i is None:
        res.add(ROW, f"{what} == source", OK, f"{key}: {len(want)} entries equal", source=src)
        return
    g = repr(got[i]) if i < len(got) else "(none)"
    w = repr(want[i]) if i < len(want) else "(none)"
    n = sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
    res.add(ROW, f"{what} == source", FAIL, f"{key}[{i}]={g[:80]} (source: {w[:80]}); {n} of {len(want)} entries "
                                            f"differ" + (f", {len(got)} vs {len(want)} entries"
                                                         if len(got) != len(want) else ""), source=src)


def _source_tokenizer(src: Path):
    tr = need("transformers")
    return tr.AutoTokenizer.from_pretrained(str(src), trust_remote_code=False)


def _added_around(tk) -> Optional[Dict[str, List[int]]]:
    """The ids encode() puts before / after plain text, or None when that depends on the text."""
    found = None
    for text in _PROBES:
        plain = list(tk(text, add_special_tokens=False)["input_ids"])
        full = list(tk(text, add_special_tokens=True)["input_ids"])
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
        if at is None:
            return None
        got = {"before": full[:at], "after": full[at + len(plain):]}
        if found is not None and got != found:
            return None
        found = got
    return found


def check_gguf_tokenizer(res: VerifyResult, reader, src: Optional[Path], student_config: Dict[str, Any],
                         n_vocab: int) -> None:
    """Rows ``tokenizer: <what> == source`` for a GGUF read by gguf-py's ``reader``; ``src`` is the
    student's source model directory (its tokenizer files), ``n_vocab`` the student's vocab_size."""
    keys = sorted(k for k in reader.fields if k.startswith("tokenizer."))
    model = _field(reader, K_MODEL)
    tj = src / "tokenizer.json" if src is not None else None
    if tj is None or not tj.is_file():
        vocab_keys = [k for k in keys if k != K_MODEL]
        if model in (None, "none") and not vocab_keys:
            res.add(ROW, "keys == source", OK, "neither the source nor the GGUF has a vocabulary")
        else:
            res.add(ROW, "keys == source", INCOMPLETE, f"not compared: the GGUF holds {names(vocab_keys)} but "
                    f"{src} has no tokenizer.json to compare them with (pass the source model's directory)")
        return
    try:
        with open(tj, encoding="utf-8") as f:
            tok_json = json.load(f)
        tk = _source_tokenizer(src)
        gguf = need("gguf")
    except Exception as e:   # Missing included: the reference cannot be read, so nothing is vouched for
        install = getattr(e, "install", "")
        res.add(ROW, "keys == source", INCOMPLETE, f"not compared: the source tokenizer in {src} does not load: "
                f"{type(e).__name__}: {str(e)[:200]}", install=install)
        return
    tmodel = tok_json.get("model") if isinstance(tok_json.get("model"), dict) else {}
    spm = bool(tmodel.get("byte_fallback"))
    checked = {K_MODEL, *BEHAVIOURAL}
    # ---- the container's tokenizer model: byte-fallback BPE is llama.cpp's SPM, byte-level BPE its "gpt2"
    want_model = "llama" if spm else "gpt2"
    bad = [] if model == want_model else [f"{K_MODEL}={model!r} (source: {tmodel.get('type')} "
                                          f"{'with' if spm else 'without'} byte fallback -> {want_model!r})"]
    # ---- tokens and types
    vocab = tk.get_vocab()
    by_id: Dict[int, str] = {}
    for t, i in vocab.items():
        by_id.setdefault(int(i), t)
    added = {int(i): bool(a.special) for i, a in tk.added_tokens_decoder.items()}
    want_tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    want_types = []
    for i in range(n_vocab):
        t = by_id.get(i)
        if t is None:
            want_types.append(UNUSED)
        elif spm and _BYTE_TOKEN.fullmatch(t):
            want_types.append(BYTE)
        elif spm and i == tk.unk_token_id:
            want_types.append(UNKNOWN)
        elif i in added:
            want_types.append(CONTROL if added[i] else USER_DEFINED)
        else:
            want_types.append(NORMAL)
    extra_ids = sorted(i for i in by_id if not 0 <= i < n_vocab)
    if extra_ids:
        bad.append(f"the source tokenizer has ids up to {extra_ids[-1]}, beyond the student's vocab_size {n_vocab}")
    src_tr = "transformers AutoTokenizer"
    checked |= {K_TOKENS, K_TYPES}
    _list_row(res, K_TOKENS, "tokens", _field(reader, K_TOKENS), want_tokens, src_tr)
    types = _field(reader, K_TYPES)
    _list_row(res, K_TYPES, "token types", None if types is None else [int(x) for x in types], want_types, src_tr)
    # ---- merges (byte-level BPE) / scores (SPM)
    checked |= {K_MERGES, K_SCORES}
    sv_merges = list(gguf.SpecialVocab(str(src), load_merges=True, n_vocab=n_vocab).merges)
    got_merges = _field(reader, K_MERGES)
    if not spm:
        _list_row(res, K_MERGES, "merges", got_merges, sv_merges, "gguf.SpecialVocab (llama.cpp's converter)")
        if _field(reader, K_SCORES) is not None:
            bad.append(f"{K_SCORES} present: the source is byte-level BPE, which llama.cpp merges by "
                       f"{K_MERGES}, so nothing vouches for these scores")
    else:
        if got_merges is not None and list(got_merges) != sv_merges:
            bad.append(f"{K_MERGES} present and unequal to the source's merges")
        _scores_row(res, _field(reader, K_SCORES), tmodel, vocab, n_vocab)
    # ---- special ids and what encode() adds
    for kind, key in SPECIAL_KEYS.items():
        checked.add(key)
        want = getattr(tk, f"{kind}_token_id", None)
        if not isinstance(want, int) and kind in ("bos", "eos", "pad"):
            want = student_config.get(f"{kind}_token_id")
        want = want if isinstance(want, int) and not isinstance(want, bool) else None
        got = _field(reader, key)
        if got is None:
            if want is not None and kind in ("bos", "eos"):
                bad.append(f"{key} missing (source: {want}); llama.cpp would use its own default")
            continue
        if want is None or int(got) != want:
            bad.append(f"{key}={int(got)} (source: {want if want is not None else 'none'})")
    around = _added_around(tk)
    if around is None:
        res.add(ROW, "add_bos/add_eos == source", FAIL, "the special tokens AutoTokenizer adds depend on the text; "
                "llama.cpp's add_bos/add_eos cannot express that", source=src_tr)
    else:
        wants = {"bos": around["before"] == [tk.bos_token_id] if around["before"] else False,
                 "eos": around["after"] == [tk.eos_token_id] if around["after"] else False, "sep": False}
        if around["before"] and not wants["bos"] or around["after"] and not wants["eos"]:
            bad.append(f"AutoTokenizer adds {around['before']} before and {around['after']} after the text, "
                       f"which add_bos/add_eos cannot express")
        for kind, key in ADD_KEYS.items():
            checked.add(key)
            got = _field(reader, key)
            if got is None:
                if wants[kind] or kind != "sep":
                    bad.append(f"{key} missing (source: {wants[kind]}); llama.cpp would use its "
                               f"pre-tokenizer's default")
            elif bool(got) != wants[kind]:
                bad.append(f"{key}={bool(got)} (source: {wants[kind]})")
    res.add(ROW, "special tokens == source", FAIL if bad else OK, "; ".join(bad[:6]) if bad else
            "model, special ids, add_bos/add_eos equal", source=src_tr + " + config.json")
    # ---- chat templates
    checked |= {K_TEMPLATE, K_TEMPLATES}
    _templates_row(res, reader, tk.chat_template, keys, checked)
    unvouched = [k for k in keys if k not in checked]
    res.ok_or_fail(ROW, "no key beyond the source's", not unvouched,
                   f"{names(unvouched)}: llama.cpp reads these and nothing in the source vouches for them"
                   if unvouched else f"{len(keys)} tokenizer.* keys, each compared")


def names(xs: List[str], k: int = 4) -> str:
    return ", ".join(xs[:k]) + (f" (+{len(xs) - k} more)" if len(xs) > k else "") if xs else "no tokenizer keys"


def _scores_row(res: VerifyResult, scores, tmodel: Dict[str, Any], vocab: Dict[str, int], n_vocab: int) -> None:
    check = "scores order == source merges"
    if scores is None or len(scores) != n_vocab:
        res.add(ROW, check, FAIL, f"{K_SCORES} has {None if scores is None else len(scores)} entries "
                                  f"(vocab {n_vocab}); llama.cpp's SPM tokenizer merges by these scores")
        return
    s = [float(x) for x in scores]
    nf = [i for i, x in enumerate(s) if not math.isfinite(x)]
    if nf:
        res.add(ROW, check, FAIL, f"{K_SCORES}[{nf[0]}]={s[nf[0]]} is not finite ({len(nf)} entries)")
        return
    prev, prev_tok = None, None
    seen = set()
    for k, m in enumerate(tmodel.get("merges") or []):
        pair = m.split(" ", 1) if isinstance(m, str) else list(m)
        if len(pair) != 2:
            continue
        a, b = pair
        i = vocab.get(a + b)
        if i is None or i in seen or not 0 <= i < n_vocab:
            continue
        seen.add(i)
        if prev is not None and not s[i] < prev:
            res.add(ROW, check, FAIL, f"{K_SCORES}[{i}]={s[i]} ({a + b!r}, merge {k}) is not below the score "
                                      f"{prev} of the earlier merge {prev_tok!r}: llama.cpp would merge in "
                                      f"another order than the source")
            return
        prev, prev_tok = s[i], a + b
    res.add(ROW, check, OK, f"{len(seen)} merge results scored in tokenizer.json's merge order",
            source="tokenizer.json merges")


def _templates_row(res: VerifyResult, reader, tmpl, keys: List[str], checked: set) -> None:
    want: Dict[str, str] = {}
    if isinstance(tmpl, str):
        want["default"] = tmpl
    elif isinstance(tmpl, dict):
        # a GGUF key name holds letters, digits and '_' only: any other character of a template's name is
        # stored as '_' (the GGUF convention gguf-py's writer follows)
        want = {re.sub(r"[^A-Za-z0-9]", "_", str(k)): v for k, v in tmpl.items() if isinstance(v, str)}
    got: Dict[str, str] = {}
    if _field(reader, K_TEMPLATE) is not None:
        got["default"] = _field(reader, K_TEMPLATE)
    for k in keys:
        if k.startswith(K_TEMPLATE + "."):
            checked.add(k)
            got[k[len(K_TEMPLATE) + 1:]] = _field(reader, k)
    listed = _field(reader, K_TEMPLATES)
    bad = []
    for name in sorted(set(want) | set(got)):
        key = K_TEMPLATE if name == "default" else f"{K_TEMPLATE}.{name}"
        if name not in got:
            bad.append(f"{key} missing (the source has this template)")
        elif name not in want:
            bad.append(f"{key} is not a template of the source: {got[name][:60]!r}")
        elif got[name] != want[name]:
            i = _first_diff(list(got[name]), list(want[name]))
            bad.append(f"{key} differs from the source's at character {i}: {got[name][max(0, (i or 0) - 10):][:50]!r} "
                       f"(source: {want[name][max(0, (i or 0) - 10):][:50]!r})")
    named = sorted(n for n in want if n != "default")
    if listed is not None or named:
        if sorted(listed or []) != named:
            bad.append(f"{K_TEMPLATES}={listed!r} (source: {named})")
    res.add(ROW, "chat templates == source", FAIL if bad else OK, "; ".join(bad[:4]) if bad else
            (f"{len(want)} template(s) equal" if want else "none (the source has no chat template)"),
            source="transformers AutoTokenizer.chat_template")
