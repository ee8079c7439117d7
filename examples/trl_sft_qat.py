"""Quantization-aware SFT with TRL: your SFTTrainer, SFTConfig, chat data and trackers; qatfactory quantizes the
model for the format you will serve (fake quantization in every forward), trains it on the labels, and exports
it at the end through the parity gate.

    python examples/trl_sft_qat.py --model /path/to/model --data chats.jsonl --out runs/sft-qat
    python examples/trl_sft_qat.py --tiny --out /tmp/sft-qat          # a random tiny model, seconds on a CPU

chats.jsonl: one {"messages": [{"role": ..., "content": ...}, ...]} per line (TRL's conversational format).
For distillation from the unquantized model instead, quantized(SFTTrainer, "qad").
"""
import argparse
import sys

from datasets import Dataset, load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from qatfactory.integrations.transformers import quantized

p = argparse.ArgumentParser()
p.add_argument("--model", help="a local Hugging Face model folder")
p.add_argument("--data", help="a JSON-lines file of conversations")
p.add_argument("--out", required=True)
p.add_argument("--format", default="nvfp4_w4a16", help="a recipe of recipes/format/ (qatfactory train format=)")
p.add_argument("--engine", default="vllm", help="vllm | sglang | llama_cpp")
p.add_argument("--max-steps", type=int, default=200)
p.add_argument("--tiny", action="store_true", help="a random tiny model and chats made here (tests, a first try)")
a = p.parse_args()

if a.tiny:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import tiny_model
    a.model, a.max_steps = tiny_model.make(f"{a.out}/tiny-model"), min(a.max_steps, 4)
    data = Dataset.from_list([{"messages": [{"role": "user", "content": t[:40]}, {"role": "assistant", "content": t}]}
                              for t in tiny_model.texts()])
else:
    data = load_dataset("json", data_files=a.data, split="train")

tok = AutoTokenizer.from_pretrained(a.model)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype="float32" if a.tiny else "bfloat16")
config = SFTConfig(output_dir=a.out, max_steps=a.max_steps, per_device_train_batch_size=2, learning_rate=1e-5,
                   lr_scheduler_type="constant", max_length=512, bf16=not a.tiny, use_cpu=a.tiny, logging_steps=1,
                   save_strategy="no", report_to="none" if a.tiny else "all")
QATSFTTrainer = quantized(SFTTrainer, "qat")               # SFTTrainer with fake quantization and our CE loss
trainer = QATSFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok,
                        format=a.format, ship=a.engine)
trainer.train()
trainer.save_model()                                       # + <out>/student: the student with its format state
if trainer.shipped is not None:                            # rank 0
    print("parity gate:", trainer.shipped.gate["verdict"], "->", trainer.shipped.path)
    sys.exit(0 if trainer.shipped.ok else 1)
