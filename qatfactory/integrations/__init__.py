"""Quantization-aware training and distillation inside loops that are not ours (a face, like the CLI):
``distill`` (the frozen teacher and the trainer's chunked loss for any loop) and ``transformers``
(Hugging Face ``Trainer`` and TRL's trainers with fake quantization, the teacher, our losses, the
student saved with its format state and a gated export at the end). Nothing below the faces imports these."""
