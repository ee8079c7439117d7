"""A few CPU steps of every built-in method through the public entry (``qatfactory.train.run``), reduced to
what must not move when the trainer's insides change: every logged number but the timings, and a SHA-256
of the trained module's tensors. ``python tests/method_bits.py --write`` records them
(tests/data/method_bits.json); tests/train/test_method_bits.py runs the same arms and compares."""
import argparse
import hashlib
import json
import math
import platform
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RECORD = HERE / "data" / "method_bits.json"
TIMING = {"step_ms", "tokens_per_s", "mem_gb", "rollout_ms", "rollout_tokens_per_s", "time_s"}
TINY = ["format=nvfp4_w4a16", "train=cpu_tiny", "train.max_steps=3", "train.eval_every=2", "train.plots=false"]
SAY7 = ["format=nvfp4_w4a16", "train=cpu_tiny", "method.rl.task=say7", "method.rl.max_new_tokens=4",
        "method.rl.mask_truncated=false", "method.rl.lora_rank=4", "method.rl.n_eval=4", "train.eval_every=2",
        "model.tiny.initializer_range=0.3", "train.lr=2e-2", "train.max_steps=3", "method.rl.prompts_per_step=2",
        "method.rl.group_size=4", "train.micro_batch=4", "train.plots=false"]
TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens 0123456789"]

ARMS = {
    "ptq": ["method=ptq", *TINY],
    "qat": ["method=qat", *TINY],
    "qat_paretoq_2bit": ["method=qat", *TINY, "format=paretoq_2bit", "quant.weight_format=int2_seq_q4_0",
                         "train.quant_start=0.5"],
    "qad": ["method=qad", *TINY],
    "qad_q4k_refresh2": ["method=qad", *TINY, "format=q4_k", "quant.kquant_refresh_every=2"],
    "qad_lean": ["method=qad", *TINY, "train.lean_act=true", "train.grad_accum=2"],
    "qad_cached": ["method=qad_cached", *TINY],
    "qad_lora": ["method=qad_lora", *TINY, "quant.lora.rank=4"],
    "grpo": ["method=grpo", *SAY7, "method.rl.num_iterations=2", "method.rl.minibatches=2", "train.micro_batch=2"],
    "grpo_merged_aqn": ["method=grpo", *SAY7, "method.rl.lora_mode=merged", "method.rl.aqn.enabled=true"],
    "dapo": ["method=dapo", *SAY7],
    "scale_adapter": ["method=scale_adapter", "train=cpu_tiny", "train.max_steps=3", "train.eval_every=2",
                      "train.plots=false", "data.text_split=lines", "data.seq_len=16", "data.eval_samples=4",
                      "train.lr=3e-2"],
}


def native_base(root: Path) -> Path:
    """A native NVFP4 checkpoint (compressed-tensors) of a tiny random Llama, and a text file to train on."""
    sys.path.insert(0, str(HERE))
    from test_exporters_helpers import student  # noqa: PLC0415 (tests' own helper)

    from qatfactory.exporters import export  # noqa: PLC0415
    if not (root / "base").exists():
        export(student("llama", "nvfp4"), root / "base", engine="vllm", flavour="compressed-tensors")
        (root / "data.txt").write_text("\n".join(TEXT * 40))
    return root


def digest(module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_arm(name: str, root: Path) -> dict:
    from qatfactory.train import compose, run  # noqa: PLC0415
    over = list(ARMS[name]) + [f"run_dir={root / name}"]
    if name == "scale_adapter":
        b = native_base(root)
        over += [f"model.path={b / 'base'}", f"data.train=[{b / 'data.txt'}]"]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        s = run(compose(over))
    finally:
        torch.set_num_threads(n)
    eng = s.pop("engine", None)
    if eng is not None:
        eng.destroy()
    recs = []
    for line in (root / name / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        recs.append({k: v for k, v in sorted(r.items()) if k not in TIMING and isinstance(v, (int, float))})
    return {"records": recs, "weights": digest(s["student"].model)}


def machine() -> dict:
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine()}


def same_number(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("arms", nargs="*")
    a = ap.parse_args()
    out = {"machine": machine(), "arms": {}}
    with tempfile.TemporaryDirectory() as d:
        for name in a.arms or ARMS:
            out["arms"][name] = run_arm(name, Path(d))
            print(name, out["arms"][name]["weights"][:16], len(out["arms"][name]["records"]), flush=True)
    if a.write:
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(out, indent=1) + "\n")
