"""method=grpo: GRPO with LoRA on the frozen quantized base (QeRL); its loop is train/rl_loop.py
(rollouts, rewards, group advantages, several policy updates per rollout)."""
from ...distill.rl import RLConfig
from .base import Method, Needs


def _rl_loop(cfg, eval_only):
    from ..rl_loop import run  # noqa: PLC0415 (cycle: rl_loop imports the trainer, which imports this registry)
    return run(cfg, eval_only)


class GRPO(Method):
    name = "grpo"
    summary = "GRPO on a task's rewards, LoRA on the quantized base, rollouts from the serving weights"
    needs = Needs(rollouts=True)
    options, options_key = RLConfig, "rl"
    quant_start_refusal = "method={name} trains adapters on a frozen base"
    own_loop = staticmethod(_rl_loop)

    def validate(self, cfg) -> None:
        super().validate(cfg)
        r = cfg.method.rl
        r.validate()
        if cfg.export.enabled and cfg.export.engine == "llama_cpp" and r.lora_mode == "adapter" \
                and r.export_lora == "adapter":
            # the trained policy is the base plus a PEFT adapter (vllm serve --lora-modules); a GGUF export would
            # ship the base alone, and llama.cpp LoRA adapters are not written
            raise ValueError(f"method={cfg.method.name} with export=llama_cpp and method.rl.export_lora=adapter: the "
                             f"trained policy ships as a LoRA adapter beside the base, and GGUF LoRA adapters are not "
                             f"supported; allowed: export=vllm or export=sglang (base + PEFT adapter), or "
                             f"method.rl.export_lora=merge (one GGUF of the merged policy)")
