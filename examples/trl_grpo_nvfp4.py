"""GRPO with TRL on an NVFP4 base (QeRL's recipe): the base weights frozen and fake-quantized to NVFP4 as vLLM
runs them, a LoRA adapter trained on top, and adaptive quantization noise (AQN) on the rollouts; TRL's
GRPOTrainer, reward functions and GRPOConfig as you use them. At the end, the merged student exported for vLLM
through the parity gate.

    python examples/trl_grpo_nvfp4.py --model /path/to/model --out runs/grpo-nvfp4
    python examples/trl_grpo_nvfp4.py --tiny --out /tmp/grpo           # a random tiny model, seconds on a CPU
"""
import argparse
import sys

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from qatfactory.integrations.transformers import quantized

p = argparse.ArgumentParser()
p.add_argument("--model", help="a local Hugging Face model folder")
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=200)
p.add_argument("--tiny", action="store_true", help="a random tiny model made here (tests, a first try)")
a = p.parse_args()

if a.tiny:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import tiny_model
    a.model, a.max_steps = tiny_model.make(f"{a.out}/tiny-model"), min(a.max_steps, 3)

# a toy task: answer with the digit 7 (replace with your prompts and reward functions)
prompts = Dataset.from_list([{"prompt": f"Say seven, {i}:"} for i in range(16)])


def says_seven(completions, **kwargs):
    # 1 for a 7 in the answer, less a little per character: short answers win ties
    return [(1.0 if "7" in c else 0.0) - 0.01 * len(c) for c in completions]


tok = AutoTokenizer.from_pretrained(a.model)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype="float32" if a.tiny else "bfloat16")
config = GRPOConfig(output_dir=a.out, max_steps=a.max_steps, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8 if a.tiny else 256, learning_rate=1e-5, bf16=not a.tiny, use_cpu=a.tiny,
                    logging_steps=1, save_strategy="no", report_to="none" if a.tiny else "all")
QGRPOTrainer = quantized(GRPOTrainer, "rl")                # GRPO's own loss, on our quantized base + LoRA
trainer = QGRPOTrainer(model=model, args=config, reward_funcs=says_seven, train_dataset=prompts, processing_class=tok,
                       format="nvfp4_w4a16", quant={"lora": {"rank": 8, "alpha": 16.0}},   # frozen NVFP4 base, LoRA
                       aqn={"sigma_start": 1e-2, "sigma_end": 5e-4, "stages": 3 if a.tiny else 10},
                       ship="vllm")                        # LoRA merged, quantized, exported, gated
trainer.train()
if trainer.shipped is not None:
    print("parity gate:", trainer.shipped.gate["verdict"], "->", trainer.shipped.path)
    sys.exit(0 if trainer.shipped.ok else 1)
