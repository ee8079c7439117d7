"""How far SmolLM2-135M-Instruct's bf16 forward (transformers, sdpa) is from its own fp32 forward, at 512 and at
2,048 tokens, on the CPU: the numerical floor below which no engine-vs-student KL can be read (does
sequence length alone explain a 2K KL of 0.019 to vLLM?). Run: python benchmarks/bf16_floor_cpu.py
(~1 min on 2 cores; prints one line per length and the JSON)."""
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qatfactory import assets

torch.set_num_threads(2)
d = assets.prepare_model_dir("smollm2")
tok = AutoTokenizer.from_pretrained(d)
text = "\n\n".join(assets.wiki_texts()[-400:])
ids = tok(text, return_tensors="pt").input_ids[0]
m32 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
m16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
out = {}
for seq, n in ((512, 4), (2048, 2)):
    x = ids[: seq * n].view(n, seq)
    with torch.no_grad():
        t = time.time()
        p = torch.log_softmax(m32(input_ids=x).logits.float(), -1)
        q = torch.log_softmax(m16(input_ids=x).logits.float(), -1)
    kl = (p.exp() * (p - q)).sum(-1)           # per position
    # by position band: the same sequences' first 512 positions vs the rest
    out[seq] = {"kl_mean": float(kl.mean()), "kl_first512": float(kl[:, :512].mean()),
                "kl_after512": float(kl[:, 512:].mean()) if seq > 512 else None,
                "top1_agree": float((p.argmax(-1) == q.argmax(-1)).float().mean()), "s": time.time() - t}
    print(seq, out[seq], flush=True)
print(json.dumps(out))
