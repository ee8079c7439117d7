"""A short supervised warm-up before RL: teach a small model the answer format the reward checks.

Why: GRPO/DAPO learn only from groups whose rewards differ. SmolLM2-135M-Instruct never writes
``<think>..</think><answer>N</answer>`` (nor ``#### N``) on its own, so on the H200 its pass rate on the
generated arithmetic task was 0 at the easiest level and DAPO saw reward 0 on 11 of 12 steps
(benchmarks/RESULTS.md, "RL on a quantized model"). QeRL starts from Qwen2.5-Instruct models that
already follow its format and has no SFT stage; at 135M we add one, shared by every arm: the
supervised cross-entropy of the generator's own worked solutions (rewards.py ``arith_warmup``,
``target_text``), drawn from streams no RL prompt or held-out item comes from and filtered against
every RL question (``arith_questions``). The quantized arms then quantize the warmed-up model (PTQ:
the exact serving weights of that model), so every arm starts RL from the same policy up to the
quantizer.

The loss: prompts rendered exactly as the RL loop renders them (:func:`prompt_ids`, system prompt
and chat template included), the target ``target_text(item) + EOS`` (the EOS is the action that ends a
rollout); cross-entropy on the target tokens only, mean over the batch's target tokens. Rows are
right-padded (no attention row is fully masked, see :func:`_batch`) and only the logits from the
first target position on are computed (``logits_to_keep``). A step whose loss or gradient norm is not
finite is skipped and recorded (``skipped_steps``); more than a tenth of the steps stops the warm-up.
Full fine-tuning, fp32 master weights (the model is cast back to its dtype at the end), matmuls under
bf16 autocast where the device is fast at bf16 (GPUs; CPUs with AMX/AVX512-BF16, qatfactory.cpu),
AdamW, a linear ramp over the first 10 % of the steps then cosine to 10 % of the rate, gradient norm
clipped at 1. The example order is a seeded permutation; ``deterministic=True`` also asks torch for
deterministic kernels (so two separate runs rebuild the same warm-up; the callers record its SHA-256).
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from ... import _fsutil
from ..data import _encode
from .rewards import Item, Task, target_text


def prompt_ids(tok, task: Task, items: Sequence[Item], use_chat: bool) -> List[List[int]]:
    """The token ids of each item's prompt as the RL loop and its rollouts see them."""
    out = []
    for it in items:
        if use_chat and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(task.messages(it), tokenize=False, add_generation_prompt=True)
        else:
            sys_p = task.system()
            text = (sys_p + "\n\n" if sys_p else "") + it.question + "\n"
        out.append(_encode(tok, text))
    return out


def target_ids(tok, task: Task, items: Sequence[Item]) -> List[List[int]]:
    """The token ids a rollout would have to generate to score full marks on each item (EOS included)."""
    eos = int(tok.eos_token_id)
    return [_encode(tok, target_text(it, task.answer_format)) + [eos] for it in items]


def _batch(prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], pad: int, device):
    """Right-padded [prompt | target] rows: ids, attention mask, the labels of every position's next
    token (-100 except where a target token follows) and how many last positions hold a label.

    Right, not left, padding: a left pad position can attend to nothing (every key before it is a
    pad), and a fully masked attention row is where fused attention kernels may return NaN in the
    backward; after a right pad the row still sees its real tokens."""
    rows = [list(p) + list(t) for p, t in zip(prompts, targets)]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), L), dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        r = list(p) + list(t)
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        attn[i, :len(r)] = 1
        # the logit at position j predicts the token at j + 1
        labels[i, len(p) - 1:len(r) - 1] = torch.tensor(list(t), dtype=torch.long)
    K = L - (min(len(p) for p in prompts) - 1)          # positions from the first labelled one to the end
    return ids.to(device), attn.to(device), labels[:, L - K:].to(device), K


def sft_loss(model, prompts, targets, pad: int, device) -> torch.Tensor:
    """Mean cross-entropy of the target tokens given their prompts (teacher forcing)."""
    ids, attn, labels, K = _batch(prompts, targets, pad, device)
    out = model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=K)
    logits = out.logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _autocast_dtype(device) -> Optional[torch.dtype]:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    from ...cpu import compute_dtype  # noqa: PLC0415 (a 0.3 s measurement, cached; only when warming up on CPU)
    return torch.bfloat16 if compute_dtype("cpu")["dtype"] == "bfloat16" else None


def _lr_factor(step: int, steps: int) -> float:
    ramp = max(1, steps // 10)
    if step < ramp:
        return (step + 1) / ramp
    frac = (step - ramp) / max(1, steps - ramp)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))


def weights_sha256(model) -> str:
    """SHA-256 over every parameter and buffer (name, dtype, shape, bytes) in name order: two
    warm-ups that produced the same weights have the same digest."""
    h = hashlib.sha256()
    sd = model.state_dict()
    for k in sorted(sd):
        t = sd[k].detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def sft_warmup(model, tok, task: Task, items: Sequence[Item], steps: int, lr: float = 1e-4, batch: int = 16,
               use_chat: bool = True, seed: int = 0, deterministic: bool = False,
               progress: bool = False) -> Dict[str, Any]:
    """Fine-tune ``model`` in place on ``items``' worked solutions for ``steps`` optimizer steps of
    ``batch`` examples; returns what happened (losses per step, tokens, time, compute dtype). The
    model ends in its original dtype and in eval mode."""
    if steps < 1 or batch < 1:
        raise ValueError(f"warm-up: steps={steps!r}, batch={batch!r}; allowed: ints >= 1")
    if not items:
        raise ValueError("warm-up: no examples")
    device = next(model.parameters()).device
    pad = int(tok.pad_token_id) if getattr(tok, "pad_token_id", None) is not None else int(tok.eos_token_id)
    prompts = prompt_ids(tok, task, items, use_chat)
    targets = target_ids(tok, task, items)
    orig_dtype = next(model.parameters()).dtype
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    ac = _autocast_dtype(device)
    prev_det = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    model.float()
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps))
    g = torch.Generator().manual_seed(seed)
    order: List[int] = []
    losses: List[float] = []
    grad_norms: List[float] = []
    skipped: List[int] = []
    n_tok = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415 (optional: progress bars)
        bar = tqdm(total=steps, desc="warm-up", leave=False)
    t0 = time.time()
    try:
        for step in range(steps):
            while len(order) < batch:
                order += torch.randperm(len(items), generator=g).tolist()
            idx, order = order[:batch], order[batch:]
            ps, ts = [prompts[i] for i in idx], [targets[i] for i in idx]
            with torch.autocast(device.type, dtype=ac, enabled=ac is not None):
                loss = sft_loss(model, ps, ts, pad, device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            # a non-finite loss or gradient would turn every weight into NaN through AdamW: the step is
            # skipped (as a loss scaler skips an overflow), counted, and too many of them stop the warm-up
            if bool(torch.isfinite(loss.detach())) and bool(torch.isfinite(gnorm)):
                opt.step()
            else:
                skipped.append(step)
                if len(skipped) > max(1, steps // 10):
                    raise FloatingPointError(
                        f"warm-up: non-finite loss or gradient at steps {skipped} (loss {float(loss):.4g}, "
                        f"gradient norm {float(gnorm):.4g}); the model was not changed by those steps")
            sched.step()
            grad_norms.append(float(gnorm))
            losses.append(float(loss.detach()))
            n_tok += sum(len(t) for t in ts)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    finally:
        if bar is not None:
            bar.close()
        opt.zero_grad(set_to_none=True)
        del opt
        model.to(orig_dtype)
        for n, p in model.named_parameters():
            p.requires_grad_(n in trainable)
        model.eval()
        torch.use_deterministic_algorithms(prev_det[0], warn_only=prev_det[1])
    k = max(1, min(5, steps // 4))
    return {"steps": steps, "batch": batch, "lr": lr, "examples": len(items), "target_tokens": n_tok,
            "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k, "losses": losses,
            "grad_norms": grad_norms, "skipped_steps": skipped,
            "time_s": time.time() - t0, "step_s": (time.time() - t0) / steps,
            "compute_dtype": str(ac).replace("torch.", "") if ac else "float32", "master_dtype": "float32"}


WARMUP_RECORD = _fsutil.WARMUP_RECORD
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def save_model_dir(model, tok, source_dir: Optional[str], out_dir, record: Dict[str, Any]) -> Path:
    """Write the warmed-up model as a local Hugging Face directory (safetensors, the source's tokenizer
    files copied byte for byte, or the byte tokenizer's marker) with ``record`` beside it, atomically.
    An existing ``out_dir`` is replaced only when it holds our record (a warm-up we wrote)."""
    out_dir = Path(out_dir)
    with _fsutil.atomic_dir(out_dir, replace=True, kinds=("warmup",), what="RL warm-up") as tmp:
        model.save_pretrained(tmp)
        copied = [n for n in _TOKENIZER_FILES if source_dir and (Path(source_dir) / n).is_file()]
        for n in copied:
            shutil.copyfile(Path(source_dir) / n, tmp / n)
        if not copied:
            tok.save_pretrained(tmp)
        (tmp / WARMUP_RECORD).write_text(json.dumps(record, indent=1, default=str))
    return out_dir


def read_record(out_dir) -> Optional[Dict[str, Any]]:
    f = Path(out_dir) / WARMUP_RECORD
    return json.loads(f.read_text()) if f.is_file() else None
