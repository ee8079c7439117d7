"""Teachers: a live frozen model, or a top-k cache written once by a precompute pass.

Live: the teacher runs beside the student (same tokenizer), frozen, in bf16, without optimizer
state. Under ZeRO-3 it is partitioned like the student by a second ``deepspeed.initialize`` with no
optimizer; its lm_head weight is gathered only while the student's loss reads it.

Cached: :func:`precompute_topk` runs the teacher once over the packed training samples and writes,
per token, the ``k`` largest log-probabilities (temperature 1, normalised over the whole vocabulary)
and their indices to sharded safetensors. Training then reads them by sample id and the teacher is
never loaded; :mod:`qatfactory.distill.losses` documents how the loss renormalises over the top-k set.

Cache layout (a directory, written to a temp dir and renamed, so a crash leaves no half cache)::

    meta.json                   {"k", "seq_len", "n_samples", "vocab", "fingerprint", "shards": [...],
                                 "logprob_dtype", "teacher", "teacher_sha256", "temperature"}

A cache is reused only when it was written for this run's teacher (``teacher_sha256``: the weights),
data (``fingerprint``: the tokenized samples), ``k``, ``seq_len`` and ``logprob_dtype``; its files must be
regular files of its own directory (never a link to somebody else's).
    shard-00000.safetensors     logprobs [n, seq_len, k] (float32 or bfloat16), indices [n, seq_len, k]
                                int32, sample_ids [n] int64 (consecutive)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
from safetensors.torch import save_file

from .._fsutil import TEACHER_CACHE_KEY, atomic_dir, load_safetensors, own_file
from ..exitcodes import BadInputError, CorruptFileError
from .losses import LiveTeacherOut, TopKTeacherOut


def split_causal_lm(model: nn.Module):
    """(backbone, head) of a Hugging Face causal LM: the module returning final hidden states
    (after the last norm) and the output projection."""
    base = model
    if hasattr(base, "get_base_model") and callable(base.get_base_model):   # peft
        base = base.get_base_model()
    prefix = getattr(base, "base_model_prefix", "model")
    backbone = getattr(base, prefix, None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if backbone is None or head is None:
        raise ValueError(f"{type(base).__name__}: expected a causal LM with .{prefix} (the decoder) and an "
                         f"output embedding (lm_head)")
    return backbone, head


def head_weight(head: nn.Module) -> Optional[torch.Tensor]:
    """The weight to multiply hidden states by, or None when the head is not a plain Linear without
    bias (a quantized or biased head then runs its own forward on the full hidden states)."""
    if type(head) is nn.Linear and head.bias is None:
        return head.weight
    return None


def _biased_linear(head: nn.Module) -> bool:
    return type(head) is nn.Linear and head.bias is not None


class HiddenStates(nn.Module):
    """Wraps a causal LM so that forward returns the final hidden states (what DeepSpeed wraps for
    a ZeRO-3 teacher: its hooks then gather the backbone's parameters layer by layer)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.backbone, self.head = split_causal_lm(lm)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        # packed documents: their position ids and no 2-D mask, from which transformers builds the block-diagonal
        # causal mask (as the student's forward does, train/student.py backbone_kwargs)
        kw = {"attention_mask": attention_mask} if position_ids is None else {"position_ids": position_ids}
        out = self.backbone(input_ids=input_ids, use_cache=False, **kw)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if head_weight(self.head) is None and not _biased_linear(self.head):
            return self.head(h)
        return h


@contextlib.contextmanager
def gathered(params: List[torch.Tensor]):
    """Full values of ZeRO-3 partitioned parameters for reading (no-op for ordinary tensors)."""
    zparams = [p for p in params if hasattr(p, "ds_id")]
    if not zparams:
        yield
        return
    import deepspeed  # noqa: PLC0415 (optional: deepspeed)
    with deepspeed.zero.GatheredParameters(zparams, modifier_rank=None):
        yield


class LiveTeacher:
    """A frozen teacher model. ``zero3_config``: a DeepSpeed config dict to partition it (ZeRO-3)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16, device="cpu",
                 zero3_config: Optional[dict] = None):
        model.requires_grad_(False)
        model.eval()
        self.module = HiddenStates(model)
        self.engine = None
        self.device = torch.device(device)
        if zero3_config is not None:
            import deepspeed  # noqa: PLC0415 (optional: deepspeed)
            cfg = dict(zero3_config)
            cfg.pop("optimizer", None)
            cfg.pop("scheduler", None)
            self.engine, *_ = deepspeed.initialize(model=self.module, config=cfg)
            self.engine.eval()
            self.device = self.engine.device
        else:
            self.module.to(device=device, dtype=dtype)

    @contextlib.contextmanager
    def outputs(self, input_ids, attention_mask=None, position_ids=None):
        """Yield a LiveTeacherOut for the batch; the head weight stays gathered inside the block.
        ``position_ids``: packed documents that attend only within themselves."""
        with torch.no_grad():
            runner = self.engine if self.engine is not None else self.module
            kw = {} if position_ids is None else {"position_ids": position_ids.to(self.device)}
            h = runner(input_ids.to(self.device),
                       None if attention_mask is None else attention_mask.to(self.device), **kw)
        head = self.module.head
        w = head_weight(head)
        if w is None and _biased_linear(head):
            # z = h W^T + b as [h, 1] [W, b]^T: the loss then forms the teacher's logits chunk by chunk like a
            # plain head's, never [tokens, vocabulary] at once
            with gathered([head.weight, head.bias]):
                yield LiveTeacherOut(torch.cat([h, h.new_ones(h.shape[:-1] + (1,))], -1),
                                     torch.cat([head.weight.detach(), head.bias.detach().unsqueeze(-1)], -1))
            return
        if w is None:
            yield LiveTeacherOut(h, None)
            return
        with gathered([w]):
            yield LiveTeacherOut(h, w.detach())


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 over a model's state (name, dtype, shape and bytes of every tensor, in name order): the
    teacher's identity a top-k cache records, so a cache is never reused for another teacher (another model,
    other weights, another seed of a random one, another dtype)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach()
        h.update(f"{name}\0{str(t.dtype)}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# meta.json fields, what each must hold (the reader refuses anything else, naming the field)
_INT_FIELDS = {"k": 1, "seq_len": 1, "n_samples": 0, "vocab": 1}
_STR_FIELDS = ("fingerprint", "teacher_sha256", "teacher")
LOGPROB_DTYPES = ("float32", "bfloat16")
# what a run compares with its own settings before it reuses a cache
IDENTITY_FIELDS = ("teacher_sha256", "fingerprint", "k", "seq_len", "logprob_dtype", "temperature")


class TeacherCacheMismatchError(BadInputError):
    """A cache written for another teacher, other data or other settings than this run's."""


def _check_meta(meta, meta_p: Path) -> None:
    """One line naming the file, the field and what is allowed for a meta.json a library would trip over."""
    if not isinstance(meta, dict):
        raise CorruptFileError(f"{meta_p}: holds a {type(meta).__name__}; allowed: a JSON object (a qatfactory "
                               f"teacher cache's meta.json)")
    for f, lo in _INT_FIELDS.items():
        v = meta.get(f)
        if (f in meta or f != "vocab") and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            raise CorruptFileError(f"{meta_p}: field {f!r} is {v!r}; allowed: an int >= {lo}")
    for f in _STR_FIELDS:
        if (f in meta or f == "fingerprint") and not isinstance(meta.get(f), str):
            raise CorruptFileError(f"{meta_p}: field {f!r} is {meta.get(f)!r}; allowed: a string")
    if "logprob_dtype" in meta and meta["logprob_dtype"] not in LOGPROB_DTYPES:
        raise CorruptFileError(f"{meta_p}: field 'logprob_dtype' is {meta['logprob_dtype']!r}; allowed: "
                               f"{list(LOGPROB_DTYPES)}")
    t = meta.get("temperature", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t != 1.0:
        raise CorruptFileError(f"{meta_p}: field 'temperature' is {t!r}; allowed: 1.0 (a cache holds the teacher's "
                               f"log-probabilities at temperature 1; the loss applies its own)")
    if not isinstance(meta.get("shards"), list):
        raise CorruptFileError(f"{meta_p}: field 'shards' is {meta.get('shards')!r}; allowed: a list of "
                               f"shard-NNNNN.safetensors names")


class CachedTeacher:
    """Reads a top-k cache; ``get(sample_ids)`` gives the TopKTeacherOut of those samples.

    ``expect``: the values of :data:`IDENTITY_FIELDS` this run needs (its teacher's weights_sha256, its
    data's fingerprint, method.topk, data.seq_len, method.cache_dtype); a cache that differs in any of
    them (or predates the field) is refused naming the field and both values."""

    def __init__(self, path: str, expect_fingerprint: Optional[str] = None, seq_len: Optional[int] = None,
                 expect: Optional[Dict[str, Any]] = None):
        self.path = Path(path)
        meta_p = self.path / "meta.json"
        if not meta_p.exists() and not meta_p.is_symlink():
            raise FileNotFoundError(f"teacher cache: {meta_p} not found; run the precompute pass "
                                    f"(method.teacher=cached writes it when missing)")
        own_file(self.path, "meta.json", "the teacher cache's meta.json")
        try:
            self.meta = json.loads(meta_p.read_text())
        except (OSError, ValueError) as e:
            raise CorruptFileError(f"{meta_p}: not readable JSON ({type(e).__name__}: {e}); allowed: the meta.json "
                                   f"a qatfactory teacher cache writes") from None
        _check_meta(self.meta, meta_p)
        want = dict(expect or {})
        if expect_fingerprint is not None:
            want.setdefault("fingerprint", expect_fingerprint)
        if seq_len is not None:
            want.setdefault("seq_len", int(seq_len))
        for f in IDENTITY_FIELDS:
            if f not in want:
                continue
            have = self.meta.get(f, 1.0 if f == "temperature" else "<absent: written before the field>")
            if have != want[f]:
                what = {"fingerprint": "other data (the tokenized samples)", "teacher_sha256": "other teacher weights",
                        "k": "another top-k (method.topk)", "seq_len": "another data.seq_len",
                        "logprob_dtype": "another method.cache_dtype"}.get(f, f"another {f}")
                raise TeacherCacheMismatchError(
                    f"teacher cache {self.path} was written for {what}: {f}={have!r} in {meta_p}, this run needs "
                    f"{f}={want[f]!r}; delete the cache (it is recomputed) or point method.teacher_cache elsewhere")
        self._shards = []
        for name in self.meta["shards"]:
            # only shard files of this directory: a name from meta.json is never followed elsewhere
            if not isinstance(name, str) or not re.fullmatch(r"shard-\d+\.safetensors", name):
                raise CorruptFileError(f"teacher cache {meta_p}: shard name {name!r} is not a shard of this "
                                       f"directory (allowed: shard-NNNNN.safetensors)")
            t = load_safetensors(own_file(self.path, name, "a teacher cache shard"))
            _check_shard(t, self.path / name, self.meta)
            self._shards.append((int(t["sample_ids"][0]), int(t["sample_ids"][-1]) + 1, t))
        self.k = int(self.meta["k"])

    def get(self, sample_ids) -> TopKTeacherOut:
        lps, idxs = [], []
        for s in torch.as_tensor(sample_ids).tolist():
            for a, b, t in self._shards:
                if a <= s < b:
                    lps.append(t["logprobs"][s - a])
                    idxs.append(t["indices"][s - a])
                    break
            else:
                raise IndexError(f"teacher cache {self.path}: sample {s} not present "
                                 f"(n_samples={self.meta['n_samples']})")
        return TopKTeacherOut(torch.stack(lps).float(), torch.stack(idxs).long())


def _check_shard(t: Dict[str, torch.Tensor], p: Path, meta: Dict[str, Any]) -> None:
    """A shard holds what meta.json says: [n, seq_len, k] log-probabilities and int32 indices, consecutive ids."""
    ids, lp, ix = t.get("sample_ids"), t.get("logprobs"), t.get("indices")
    if ids is None or lp is None or ix is None or ids.ndim != 1 or ids.numel() == 0 or ids.dtype != torch.int64:
        raise CorruptFileError(f"{p}: allowed: tensors sample_ids (int64 [n], n >= 1), logprobs, indices")
    want = (ids.numel(), meta["seq_len"], meta["k"])
    if tuple(lp.shape) != want or tuple(ix.shape) != want or ix.dtype != torch.int32 or \
            lp.dtype not in (torch.float32, torch.bfloat16):
        raise CorruptFileError(f"{p}: logprobs {lp.dtype} {tuple(lp.shape)} / indices {ix.dtype} {tuple(ix.shape)}; "
                               f"allowed: [{want[0]}, {want[1]}, {want[2]}] (n, meta.json's seq_len, k), float and "
                               f"int32")
    if not torch.equal(ids, torch.arange(int(ids[0]), int(ids[0]) + ids.numel())):
        raise CorruptFileError(f"{p}: sample_ids are not consecutive")


@torch.no_grad()
def precompute_topk(teacher: LiveTeacher, samples, out_dir: str, k: int, batch_size: int = 4,
                    shard_samples: int = 256, chunk_tokens: int = 1024, logprob_dtype: str = "float32",
                    teacher_name: str = "", vocab: Optional[int] = None, teacher_sha256: Optional[str] = None) -> Path:
    """Write the top-k cache for ``samples`` (a data.Samples) to ``out_dir`` atomically. ``teacher_sha256``:
    the teacher's identity (:func:`weights_sha256` of its model; computed here when not given)."""
    if k < 1:
        raise ValueError(f"precompute_topk: k={k}; allowed: an int >= 1")
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(logprob_dtype)
    if dt is None:
        raise ValueError(f"precompute_topk: logprob_dtype={logprob_dtype!r}; allowed: ['float32', 'bfloat16']")
    if teacher_sha256 is None:
        teacher_sha256 = weights_sha256(teacher.module)
    out = Path(out_dir)
    # replaces only a missing or empty directory or an earlier cache: a folder of the user's own that happens
    # to sit at out_dir (method.teacher_cache=DIR puts DIR/train and DIR/eval here) is refused, never deleted
    with atomic_dir(out, replace=True, kinds=("teacher_cache",), what="teacher cache") as tmp:
        shards: List[str] = []
        n = len(samples)
        L = samples.input_ids.shape[1]
        for s0 in range(0, n, shard_samples):
            s1 = min(n, s0 + shard_samples)
            lp_all = torch.empty(s1 - s0, L, k, dtype=dt)
            ix_all = torch.empty(s1 - s0, L, k, dtype=torch.int32)
            for b0 in range(s0, s1, batch_size):
                b1 = min(s1, b0 + batch_size)
                pos = getattr(samples, "pos", None)
                with teacher.outputs(samples.input_ids[b0:b1], samples.attn[b0:b1],
                                     None if pos is None else pos[b0:b1]) as t:
                    h = t.hidden.reshape(-1, t.hidden.shape[-1])
                    rows_lp, rows_ix = [], []
                    for c in range(0, h.shape[0], chunk_tokens):
                        z = (h[c:c + chunk_tokens] @ t.weight.t() if t.weight is not None
                             else h[c:c + chunk_tokens]).float()
                        if k > z.shape[-1]:
                            raise ValueError(f"precompute_topk: k={k} exceeds the vocabulary {z.shape[-1]}")
                        vocab = z.shape[-1]
                        v, i = torch.log_softmax(z, -1).topk(k, dim=-1)
                        rows_lp.append(v)
                        rows_ix.append(i)
                lp_all[b0 - s0:b1 - s0] = torch.cat(rows_lp).view(b1 - b0, L, k).to(dt)
                ix_all[b0 - s0:b1 - s0] = torch.cat(rows_ix).view(b1 - b0, L, k).to(torch.int32)
            name = f"shard-{len(shards):05d}.safetensors"
            save_file({"logprobs": lp_all.contiguous(), "indices": ix_all.contiguous(),
                       "sample_ids": torch.arange(s0, s1, dtype=torch.int64)}, str(tmp / name))
            shards.append(name)
        meta = {"k": int(k), "seq_len": int(L), "n_samples": int(n), "vocab": vocab,
                "fingerprint": samples.fingerprint(), "shards": shards, "logprob_dtype": logprob_dtype,
                "teacher": teacher_name, "teacher_sha256": teacher_sha256, "temperature": 1.0,
                "renormalisation": "teacher softmax(l/tau) over the top-k set; see qatfactory.distill.losses",
                TEACHER_CACHE_KEY: 1}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return out
