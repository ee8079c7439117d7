"""Quantization-aware distillation in a Hugging Face Trainer script: the Trainer, TrainingArguments, collator,
DeepSpeed config and trackers you already use; qatfactory adds NVFP4 fake quantization, the frozen teacher, its
chunked KL loss, and at the end a vLLM export proven by the parity gate.

    python examples/hf_trainer_qad.py --model /path/to/model --data train.txt --out runs/hf-qad
    accelerate launch --num_processes 2 examples/hf_trainer_qad.py --model ... --deepspeed examples/ds_zero2.json
    deepspeed --num_gpus 2 examples/hf_trainer_qad.py --model ... --deepspeed examples/ds_zero2.json    (CPU: gloo)
    python examples/hf_trainer_qad.py --tiny --out /tmp/hf-qad       # a random tiny model, seconds on a CPU
"""
import argparse
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

from qatfactory.integrations.transformers import QADTrainer

p = argparse.ArgumentParser()
p.add_argument("--model", help="a local Hugging Face model folder")
p.add_argument("--data", help="a text file; blank lines separate documents")
p.add_argument("--out", required=True)
p.add_argument("--format", default="nvfp4_w4a16", help="a recipe of recipes/format/ (qatfactory train format=)")
p.add_argument("--engine", default="vllm", help="vllm | sglang | llama_cpp")
p.add_argument("--max-steps", type=int, default=200)
p.add_argument("--deepspeed", default=None, help="a DeepSpeed JSON config (ZeRO-2 / ZeRO-3)")
# the `deepspeed` launcher passes each process its rank as --local_rank (torchrun and accelerate set LOCAL_RANK)
p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
p.add_argument("--tiny", action="store_true", help="a random tiny model and text made here (tests, a first try)")
a = p.parse_args()

if a.tiny:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import tiny_model
    a.model = a.model or tiny_model.make(f"{a.out}/tiny-model")      # several ranks: make it once, give --model
    docs, a.max_steps = tiny_model.texts(), min(a.max_steps, 4)
else:
    docs = [d for d in open(a.data).read().split("\n\n") if d.strip()]

tok = AutoTokenizer.from_pretrained(a.model)
tok.pad_token = tok.pad_token or tok.eos_token
model = AutoModelForCausalLM.from_pretrained(a.model, dtype="float32" if a.tiny else "bfloat16")
train = [tok(d, truncation=True, max_length=512) for d in docs]

args = TrainingArguments(output_dir=a.out, max_steps=a.max_steps, per_device_train_batch_size=2,
                         learning_rate=1e-5, lr_scheduler_type="constant", bf16=not a.tiny, use_cpu=a.tiny,
                         activation_checkpointing=not a.tiny, logging_steps=1, save_strategy="no",
                         report_to="none" if a.tiny else "all", deepspeed=a.deepspeed)
trainer = QADTrainer(model=model, args=args, train_dataset=train, processing_class=tok,
                     data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                     format=a.format, ship=a.engine)       # teacher: a frozen copy of the model before quantization
trainer.train()
print(f"trained on {args.world_size} rank(s){' with DeepSpeed' if trainer.is_deepspeed_enabled else ''}")
trainer.save_model()                                       # + <out>/student: the student with its format state
if trainer.shipped is not None:                            # rank 0
    print("parity gate:", trainer.shipped.gate["verdict"], "->", trainer.shipped.path)
    sys.exit(0 if trainer.shipped.ok else 1)
