"""A training method registered from outside the package: plain SFT on the hard labels.

    qatfactory train plugins=[toy_method] method=toy_sft ...    (this directory on PYTHONPATH)
"""
from dataclasses import dataclass

import torch.nn.functional as F

from qatfactory.train.methods import Method, register


@dataclass
class ToyOptions:                     # method.options.* of this method (checked against this schema)
    label_smoothing: float = 0.0


@register
class ToySFT(Method):
    name = "toy_sft"
    recipe = {"method": {"name": "toy_sft", "eval_teacher": False, "loss": {"kind": "ce"}}, "train": {"lr": 1e-3}}
    options = ToyOptions
    calls, smoothing = 0, 0.0

    def loss(self, student, input_ids, attn, mask, teacher):
        self.calls += 1
        logits = student.lm(input_ids=input_ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        keep = mask[:, 1:] & attn[:, 1:].bool()
        return F.cross_entropy(logits[keep], input_ids[:, 1:][keep], label_smoothing=self.smoothing)

    def begin(self, ctx, state):
        self.smoothing = self.opts(ctx.cfg).label_smoothing

    def end(self, ctx):
        ctx.say(f"toy_sft: {self.calls} loss calls")
        return False


@dataclass
class ToyBlock:                       # method.toy.* : a typed block in the run's schema, like method.rl
    label_smoothing: float = 0.0
    note: str = ""


@register
class ToyKeyed(ToySFT):
    name = "toy_keyed"
    summary = "toy SFT whose options are a block of the run's schema"
    recipe = {"method": {"name": "toy_keyed", "eval_teacher": False, "loss": {"kind": "ce"}}, "train": {"lr": 1e-3}}
    options, options_key = ToyBlock, "toy"
