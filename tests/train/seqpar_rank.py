"""One rank of tests/train/test_seqpar.py: the loss and gradients of a tiny Llama on one sequence, first whole on
this rank (the reference), then under Ulysses sequence parallelism over all ranks; rank 0 writes the differences."""
import copy
import json
import sys

import deepspeed
import deepspeed.comm as dist
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qatfactory import quantize as Q
from qatfactory.distill.losses import LossConfig
from qatfactory.quantize import QuantConfig
from qatfactory.distill.teachers import LiveTeacher, split_causal_lm
from qatfactory.train import seqpar
from qatfactory.train.student import StudentLM

out_path = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo")
world, rank = dist.get_world_size(), dist.get_rank()
torch.set_num_threads(1)


def llama(seed):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                                        torch_dtype=torch.float64)).double()


student, teacher = llama(0), llama(7)
# the same student fake-quantized to NVFP4 with its lm_head: a head that runs its own forward, chunk by chunk
qstudent = copy.deepcopy(student)
Q.prepare(qstudent, QuantConfig.preset("nvfp4_w4a16", quantize_lm_head=True))
assert type(qstudent.lm_head).__name__ == "QuantLinear"
models = {"": student, "qhead-": qstudent}
g = torch.Generator().manual_seed(3)
T = 24
ids = torch.randint(0, 97, (2, T), generator=g)
attn = torch.ones_like(ids)
mask = torch.ones(2, T, dtype=torch.bool)
mask[0, :5] = False                          # a prompt that does not count
lt = LiveTeacher(teacher, torch.float64)
kinds = sys.argv[2].split(",")
runs = [(name, kind) for name in models for kind in kinds]


def config(kind):
    extra = {"top_k": 9} if kind == "topk_kl" else {}
    return LossConfig(kind=kind, chunk_tokens=5, ce_weight=0.0 if kind == "ce" else 0.25, **extra)


# the references first (enable() replaces sdpa in transformers' table): the whole sequence on this rank, through
# the trainer's own module
refs = {}
for name, kind in runs:
    cfg, m = config(kind), models[name]
    with lt.outputs(ids, attn) as t:
        ref = StudentLM(m, cfg)(ids, attn, mask, t if cfg.needs_teacher else None)
    ref.backward()
    refs[name + kind] = (float(ref), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    m.zero_grad()

group, sp_rank = seqpar.enable(student, world, micro_batch=2)
part = seqpar.shard(ids, mask, attn, sp_rank, world)
res = {"shard": list(part["input_ids"].shape)}
for name, kind in runs:
    cfg, m = config(kind), models[name]
    backbone, head = split_causal_lm(m)
    with lt.outputs(part["input_ids"], None, part["position_ids"]) as t:
        loss = seqpar.sp_loss(backbone, head, part, t, cfg, group, world)
    loss.backward()
    ref, ref_grads = refs[name + kind]
    # what the data-parallel step does with the ranks' gradients: their mean
    diff = {}
    for n, p in m.named_parameters():
        if p.grad is None:
            continue
        gr = p.grad.clone()
        dist.all_reduce(gr)
        gr /= world
        diff[n] = float((gr - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30))
    m.zero_grad()
    tot = loss.detach().clone()
    dist.all_reduce(tot)
    tot /= world                                  # the loop's logged loss: the ranks' mean
    res[name + kind] = {"ref": ref, "sp": float(tot), "own": float(loss), "grad_rel": diff}
if rank == 0:
    json.dump(res, open(out_path, "w"))
dist.barrier()
