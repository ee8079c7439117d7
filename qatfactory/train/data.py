"""Training data: local text / jsonl / saved ``datasets`` -> fixed-length token samples -> a
deterministic, resumable order.

* ``.txt``: one document per file (``text_split: "lines"`` makes one per non-empty line).
* ``.jsonl``: ``{"text": ...}`` records, or chat records ``{"messages": [{"role", "content"}, ...]}``
  rendered with the tokenizer's chat template; the loss then covers only the last assistant turn
  (everything before it, the prompt, is masked), which is what a chat model is served to produce.
* a directory written by ``datasets.Dataset.save_to_disk`` (needs the ``datasets`` package).

Samples are ``seq_len`` tokens. With ``pack`` (default) documents are joined, each followed by EOS,
and cut into consecutive samples (the tail shorter than a sample is dropped). Attention runs across
document boundaries, as in most pretraining packers, unless ``doc_mask``: each sample then carries
``position_ids`` that restart at 0 at every document start (and at the sample start), and the trainer
runs the model with them and no 2-D attention mask, which Hugging Face models (transformers 5) turn into a
block-diagonal causal mask (sdpa / eager / flex) or varlen flash attention: no token attends across a
boundary. Without ``pack`` each document is truncated or
right-padded to ``seq_len`` (padding masked out of attention and loss).

``mask[t]`` says whether token ``t`` is a target: the loss at position ``t-1`` predicts it.

Order: epoch ``e`` visits the samples in ``randperm(n, seed + e)``; a position is the count of samples
consumed so far, so (seed, position) reproduces the rest of a run exactly on resume. Each global
micro-batch of ``world * micro`` samples is split by rank.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .._inputs import loads
from ..exitcodes import BadInputError

MAX_SEQ_LEN = 131072


@dataclass
class DataConfig:
    """Hydra schema ``data``."""

    train: List[str] = field(default_factory=list)   # files or directories; empty + synthetic>0 for tests
    eval: List[str] = field(default_factory=list)    # empty: hold out eval_samples packed samples from train
    eval_samples: int = 8
    seq_len: int = 512
    pack: bool = True
    text_field: str = "text"
    messages_field: str = "messages"
    text_split: str = "file"      # "file" | "lines" (for .txt)
    max_docs: Optional[int] = None
    synthetic: int = 0            # >0: this many random-token samples (no tokenizer needed)
    # structured: each token repeats its predecessor + 1 half the time (learnable, for tests);
    # uniform: ids drawn uniformly from the vocabulary minus the tokenizer's special tokens (the QAD
    # report's random-token data). With data.eval files the held-out set is that real text.
    synthetic_kind: str = "structured"
    # packed documents attend only within themselves (position ids restart per document; see above)
    doc_mask: bool = False

    def __post_init__(self):
        self.train, self.eval = list(self.train), list(self.eval)
        if not 2 <= int(self.seq_len) <= MAX_SEQ_LEN:
            raise ValueError(f"DataConfig.seq_len={self.seq_len!r}; allowed: 2..{MAX_SEQ_LEN}")
        if self.text_split not in ("file", "lines"):
            raise ValueError(f"DataConfig.text_split={self.text_split!r}; allowed: ['file', 'lines']")
        if self.synthetic_kind not in ("structured", "uniform"):
            raise ValueError(f"DataConfig.synthetic_kind={self.synthetic_kind!r}; allowed: ['structured', 'uniform']")
        if not isinstance(self.doc_mask, bool):
            raise ValueError(f"DataConfig.doc_mask={self.doc_mask!r}; allowed: true or false")
        if self.doc_mask and self.synthetic:
            raise ValueError(f"DataConfig.doc_mask=true with synthetic={self.synthetic}; allowed: doc_mask with text "
                             f"files (random-token samples hold no documents)")
        if self.doc_mask and not self.pack:
            raise ValueError("DataConfig.doc_mask=true with pack=false; allowed: doc_mask with pack=true (unpacked "
                             "samples hold one document each)")
        if self.eval_samples < 0 or self.synthetic < 0:
            raise ValueError(f"DataConfig eval_samples={self.eval_samples!r}, synthetic={self.synthetic!r}; "
                             f"allowed: ints >= 0")


# ----------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) plus BOS/EOS/PAD: the tokenizer of the random tiny models
    used in tests, where no trained tokenizer exists offline."""

    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    vocab_size = 259
    chat_template = "byte"

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return list(text.encode("utf-8"))

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **_):
        s = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        if add_generation_prompt:
            s += "<|assistant|>\n"
        return self.encode(s) if tokenize else s

    def save_pretrained(self, path) -> None:
        """A marker file, so a saved tiny model directory loads with this tokenizer again."""
        (Path(path) / BYTE_TOKENIZER_FILE).write_text('{"tokenizer": "qatfactory byte tokenizer", "vocab_size": 259}\n')


BYTE_TOKENIZER_FILE = "qatfactory_byte_tokenizer.json"


def load_tokenizer(path: Optional[str]):
    if not path or (Path(path) / BYTE_TOKENIZER_FILE).is_file():
        return ByteTokenizer()
    from transformers import AutoTokenizer  # noqa: PLC0415 (heavy: transformers)
    return AutoTokenizer.from_pretrained(path)


def _encode(tok, text: str) -> List[int]:
    if isinstance(tok, ByteTokenizer):
        return tok.encode(text)
    return tok(text, add_special_tokens=False)["input_ids"]


def _eos(tok) -> int:
    eos = getattr(tok, "eos_token_id", None)
    if eos is None:
        raise ValueError("data: the tokenizer has no eos_token_id; packing needs one to separate documents")
    return int(eos)


# ----------------------------------------------------------------------------- documents
def _records(path: Path, cfg: DataConfig) -> Iterable[dict]:
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "state.json").exists() \
                or (path / "dataset_dict.json").exists():
            try:
                import datasets  # noqa: F401,PLC0415 (optional: datasets)
            except ImportError:
                raise ImportError(f"data: {path} is a saved `datasets` directory but the `datasets` package is "
                                  f"not installed; pip install datasets (or export it to jsonl)") from None
            ds = datasets.load_from_disk(str(path))
            if hasattr(ds, "keys"):     # a DatasetDict: take "train" or the only split
                ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
            yield from ds
            return
        for p in sorted(path.rglob("*")):
            if p.suffix in (".txt", ".jsonl", ".json") and p.is_file():
                yield from _records(p, cfg)
        return
    if not path.exists():
        raise FileNotFoundError(f"data: {path} does not exist")
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if line.strip():
                    # nesting limited (a deep record would end in the parser's RecursionError); exit 4 naming the line
                    yield loads(line, f"data: {path}:{i + 1}", finite=False)
        return
    if path.suffix == ".txt" or cfg.text_split:
        text = path.read_text(encoding="utf-8")
        if cfg.text_split == "lines":
            for line in text.splitlines():
                if line.strip():
                    yield {cfg.text_field: line}
        else:
            yield {cfg.text_field: text}


def _tokenize_record(rec: dict, tok, cfg: DataConfig, where: str) -> Tuple[List[int], List[bool]]:
    if not isinstance(rec, dict):
        raise BadInputError(f"data: {where} is a JSON {type(rec).__name__}; allowed: an object with "
                            f"{cfg.text_field!r} or {cfg.messages_field!r}")
    if cfg.messages_field in rec and rec[cfg.messages_field]:
        msgs = rec[cfg.messages_field]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in msgs):
            raise BadInputError(f"data: {where}: field {cfg.messages_field!r} = {str(msgs)[:60]!r}; allowed: a list "
                                f"of {{'role': str, 'content': str}} objects")
        if getattr(tok, "chat_template", None) is None:
            raise ValueError(f"data: {where} holds chat messages but the tokenizer has no chat template")
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=None)
        if last is None:
            raise BadInputError(f"data: {where} has messages but no assistant turn to train on; allowed: a "
                                f"conversation with at least one message of role 'assistant'")
        full = tok.apply_chat_template(msgs[:last + 1], tokenize=False)
        prompt = tok.apply_chat_template(msgs[:last], tokenize=False, add_generation_prompt=True)
        if not full.startswith(prompt):
            raise ValueError(f"data: {where}: the chat template's prompt is not a prefix of the conversation; "
                             f"cannot mask the prompt tokens")
        p_ids = _encode(tok, prompt)
        a_ids = _encode(tok, full[len(prompt):])
        return p_ids + a_ids, [False] * len(p_ids) + [True] * len(a_ids)
    if cfg.text_field in rec:
        ids = _encode(tok, str(rec[cfg.text_field]))
        return ids, [True] * len(ids)
    raise BadInputError(f"data: {where} has neither {cfg.text_field!r} nor {cfg.messages_field!r}; "
                        f"keys: {sorted(rec)[:10]}")


@dataclass
class Samples:
    """Fixed-length samples: ``input_ids``, ``mask`` (target counts), ``attn`` (attention), [N, L];
    ``pos``: position ids restarting at each packed document (``doc_mask``), or None."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    attn: torch.Tensor
    pos: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx) -> Dict[str, torch.Tensor]:
        idx = torch.as_tensor(idx, dtype=torch.long)
        out = {"input_ids": self.input_ids[idx], "mask": self.mask[idx], "attn": self.attn[idx], "sample_ids": idx}
        if self.pos is not None:
            out["position_ids"] = self.pos[idx]
        return out

    def slice(self, a: int, b: int) -> "Samples":
        return Samples(self.input_ids[a:b], self.mask[a:b], self.attn[a:b],
                       None if self.pos is None else self.pos[a:b])

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.input_ids.numpy().tobytes())
        h.update(self.mask.numpy().tobytes())
        if self.pos is not None:         # the teacher sees other attention: a cache of it is another cache
            h.update(self.pos.numpy().tobytes())
        return h.hexdigest()[:16]


def build_samples(paths: Sequence[str], tok, cfg: DataConfig) -> Samples:
    L = int(cfg.seq_len)
    docs: List[Tuple[List[int], List[bool]]] = []
    for p in paths:
        for i, rec in enumerate(_records(Path(p), cfg)):
            if cfg.max_docs is not None and len(docs) >= cfg.max_docs:
                break
            ids, m = _tokenize_record(rec, tok, cfg, f"{p} record {i}")
            if ids:
                docs.append((ids, m))
    if not docs:
        raise ValueError(f"data: no documents found in {list(paths)}")
    if cfg.pack:
        eos = _eos(tok)
        flat, fmask, fpos = [], [], []
        for ids, m in docs:
            flat += ids + [eos]
            fmask += m + [m[-1]]      # EOS after a trained span is a target too
            fpos += range(len(ids) + 1)
        n = len(flat) // L
        if n == 0:
            raise ValueError(f"data: {len(flat)} tokens in {list(paths)} do not fill one sample of "
                             f"seq_len={L}; lower data.seq_len or add text")
        ids = torch.tensor(flat[: n * L], dtype=torch.long).view(n, L)
        mask = torch.tensor(fmask[: n * L], dtype=torch.bool).view(n, L)
        pos = None
        if cfg.doc_mask:
            pos = torch.tensor(fpos[: n * L], dtype=torch.long).view(n, L)
            # a document cut by the sample boundary continues from position 0, as an unpacked one would start
            first = pos[:, :1].clone()
            pos = torch.where(torch.cumsum((pos == 0).long(), 1) == 0, pos - first, pos)
        return Samples(ids, mask, torch.ones(n, L, dtype=torch.long), pos)
    pad = getattr(tok, "pad_token_id", None)
    pad = _eos(tok) if pad is None else int(pad)
    ids = torch.full((len(docs), L), pad, dtype=torch.long)
    mask = torch.zeros(len(docs), L, dtype=torch.bool)
    attn = torch.zeros(len(docs), L, dtype=torch.long)
    for i, (d, m) in enumerate(docs):
        d, m = d[:L], m[:L]
        ids[i, : len(d)] = torch.tensor(d)
        mask[i, : len(m)] = torch.tensor(m)
        attn[i, : len(d)] = 1
    return Samples(ids, mask, attn)


def synthetic_samples(n: int, seq_len: int, vocab: int, seed: int) -> Samples:
    """Random tokens with a learnable structure (each token repeats its predecessor + 1 half the time),
    for tests and benchmarks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq_len), generator=g)
    rep = torch.rand(n, seq_len, generator=g) < 0.5
    for t in range(1, seq_len):
        ids[:, t] = torch.where(rep[:, t], (ids[:, t - 1] + 1) % vocab, ids[:, t])
    return Samples(ids, torch.ones(n, seq_len, dtype=torch.bool), torch.ones(n, seq_len, dtype=torch.long))


def special_ids(tok) -> List[int]:
    ids = getattr(tok, "all_special_ids", None)
    if ids is None:
        ids = [getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    return sorted({int(i) for i in ids if i is not None})


def uniform_samples(n: int, seq_len: int, vocab: int, seed: int, exclude: Sequence[int] = ()) -> Samples:
    """Token ids drawn uniformly and independently from range(vocab) minus ``exclude``."""
    keep = torch.ones(vocab, dtype=torch.bool)
    bad = [i for i in exclude if 0 <= i < vocab]
    keep[bad] = False
    pool = torch.nonzero(keep).flatten()
    g = torch.Generator().manual_seed(seed)
    ids = pool[torch.randint(0, len(pool), (n, seq_len), generator=g)]
    return Samples(ids, torch.ones(n, seq_len, dtype=torch.bool), torch.ones(n, seq_len, dtype=torch.long))


def load_data(cfg: DataConfig, tok, vocab: int, seed: int) -> Tuple[Samples, Samples]:
    """(train, eval) samples."""
    if cfg.synthetic:
        n_ev = 0 if cfg.eval else cfg.eval_samples
        if cfg.synthetic_kind == "uniform":
            allx = uniform_samples(cfg.synthetic + n_ev, cfg.seq_len, vocab, seed, special_ids(tok))
        else:
            allx = synthetic_samples(cfg.synthetic + n_ev, cfg.seq_len, vocab, seed)
        if cfg.eval:
            return allx.slice(0, cfg.synthetic), build_samples(cfg.eval, tok, cfg)
        return allx.slice(0, cfg.synthetic), allx.slice(cfg.synthetic, len(allx))
    if not cfg.train:
        raise ValueError("DataConfig.train is empty; give files/directories, or data.synthetic=N for random tokens")
    train = build_samples(cfg.train, tok, cfg)
    if cfg.eval:
        return train, build_samples(cfg.eval, tok, cfg)
    k = min(cfg.eval_samples, max(len(train) - 1, 0))
    if len(train) - k < 1:
        raise ValueError(f"data: only {len(train)} samples; nothing left to train on after holding out "
                         f"{k} for eval")
    # hold out the tail, so the held-out text never appears in training
    return train.slice(0, len(train) - k), train.slice(len(train) - k, len(train))


class Order:
    """Deterministic sample order by (seed, position); see the module docstring."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError("data: no training samples")
        self.n, self.seed = n, int(seed)
        self._epoch, self._perm = -1, None

    def _perm_for(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=g), epoch
        return self._perm

    def take(self, position: int, count: int) -> List[int]:
        out = []
        for p in range(position, position + count):
            out.append(int(self._perm_for(p // self.n)[p % self.n]))
        return out


def rank_batch(samples: Samples, order: Order, position: int, micro: int, rank: int, world: int):
    """This rank's micro-batch at a global position; the position then advances by micro * world."""
    ids = order.take(position, micro * world)[rank * micro:(rank + 1) * micro]
    return samples.select(ids)
