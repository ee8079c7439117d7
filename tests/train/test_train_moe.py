"""A random Qwen3-MoE through the real trainer (model=tiny_qwen3_moe, the step benchmark's MoE shape on CPU, fp32):
the configuration refuses impossible shapes with the field named, QAD and QAT train the fused 3-D
experts, and the trained student's forward runs its experts on exactly the NVFP4 values that NVIDIA Model Optimizer's
own NVFP4 quantizer (NVFP4QTensor, one per-tensor scale per expert: vLLM's ``w13_weight_scale_2``) gives
for the trained expert weights: an oracle that shares no code with ours. The per-step weight cache on
the MoE is checked against the per-forward path in tests/nn/test_weight_cache.py."""
import copy

import pytest
import torch

from qatfactory.exitcodes import UsageError
from qatfactory.train.config import compose

MOE = ["train=cpu_tiny", "model=tiny_qwen3_moe", "data.synthetic=16", "data.seq_len=32", "data.eval_samples=2",
       "train.eval_every=0", "train.max_steps=3", "train.grad_accum=2", "train.lr=1e-2",
       "model.tiny.initializer_range=0.3"]


def test_the_tiny_moe_recipe_builds_transformers_qwen3_moe():
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    from qatfactory.train.runtime import build_model
    cfg = compose(MOE + ["model.tiny.num_experts=6", "model.tiny.num_experts_per_tok=3",
                         "model.tiny.moe_intermediate_size=48"])
    m, _, src = build_model(cfg)
    assert src is None and type(m) is Qwen3MoeForCausalLM
    ex = m.model.layers[1].mlp.experts
    assert type(ex) is Qwen3MoeExperts and m.config._experts_implementation == "grouped_mm"
    assert ex.gate_up_proj.shape == (6, 96, 64) and ex.down_proj.shape == (6, 64, 48)
    assert m.config.num_experts_per_tok == 3 and m.config.head_dim == 16 and m.config.norm_topk_prob
    assert next(m.parameters()).dtype == torch.float32
    # the same seed, the same model; another seed, another
    m2, _, _ = build_model(cfg)
    assert torch.equal(m2.model.layers[0].mlp.experts.down_proj, m.model.layers[0].mlp.experts.down_proj)
    m3, _, _ = build_model(compose(MOE + ["model.init_seed=1"]))
    assert not torch.equal(m3.model.layers[0].mlp.experts.down_proj, m.model.layers[0].mlp.experts.down_proj)


@pytest.mark.parametrize("over,msg", [
    (["model.tiny.num_experts_per_tok=9"], r"num_experts_per_tok=9 > model.tiny.num_experts=8; allowed: 1..num_experts"),
    (["model.tiny.num_experts=0"], r"model.tiny.num_experts=0; allowed: an int >= 1"),
    (["model.tiny.moe_intermediate_size=0"], r"moe_intermediate_size=0; allowed: an int >= 1"),
    (["model.tiny.arch=mamba"], r"model.tiny.arch='mamba'; allowed: \['llama', 'qwen3_moe'\]"),
    (["model.tiny.arch=llama"], r"model.tiny.arch='llama' with model.name='tiny_qwen3_moe'.*model=tiny_llama"),
    (["model.tiny.num_key_value_heads=3"], r"num_attention_heads=4 is not a multiple of .*num_key_value_heads=3"),
    (["model.tiny.head_dim=7"], r"model.tiny.head_dim=7; allowed: an even int"),
    (["model.tiny.head_dim=null", "model.tiny.hidden_size=66"], r"hidden_size=66 is not a multiple.*set model.tiny.head_dim"),
    (["model=tiny_llama", "model.tiny.arch=qwen3_moe"], r"model.name='tiny_llama', which builds 'llama'.*model=tiny_qwen3_moe"),
    (["model=tiny_llama", "model.tiny.head_dim=32"], r"head_dim=32 with model.tiny.arch='llama'; allowed: null"),
    (["model=tiny_llama", "model.tiny.intermediate_size=0"], r"intermediate_size=0; allowed: an int >= 1"),
    (["model.name=my_moe"], r"model.path is null for model.name='my_moe'.*model=\['tiny_llama', 'tiny_qwen3_moe'\]"),
])
def test_impossible_moe_shapes_are_refused_with_the_field_named(over, msg):
    with pytest.raises(UsageError, match=msg):
        compose(MOE + over)


def _modelopt_nvfp4(w3d: torch.Tensor) -> torch.Tensor:
    """Model Optimizer's NVFP4 quantize + dequantize of each expert [R, K] (its own per-tensor scale
    amax / (6 * 448) and E4M3 block-16 scales), stacked back to [E, R, K]."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    out = []
    for e in range(w3d.shape[0]):
        qt, sc, g = NVFP4QTensor.quantize(w3d[e].detach().float().clone(), 16)
        out.append(qt.dequantize(torch.float32, scale=sc, double_scale=g, block_sizes={-1: 16}))
    return torch.stack(out)


@pytest.mark.parametrize("method", ["qad", "qat"])
def test_training_moves_the_experts_and_runs_them_on_modelopts_nvfp4_values(tmp_path, method):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    from qatfactory.nn import QuantExpertsMixin, step_cache
    from qatfactory.train.loop import run
    from qatfactory.train.runtime import build_model
    cfg = compose(MOE + [f"method={method}", "format=nvfp4_w4a16", f"run_dir={tmp_path / method}"])
    init, _, _ = build_model(cfg)
    s = run(cfg)
    s.pop("engine").destroy()
    student = s["student"].model.eval()
    layers = student.model.layers
    assert all(isinstance(l.mlp.experts, QuantExpertsMixin) for l in layers)
    for a, b in zip(layers, init.model.layers):      # the loss's gradients reached the 3-D expert tensors
        assert not torch.equal(a.mlp.experts.gate_up_proj, b.mlp.experts.gate_up_proj)
        assert not torch.equal(a.mlp.experts.down_proj, b.mlp.experts.down_proj)

    # the reference: the trained student with each layer's experts put back to transformers' own class,
    # holding Model Optimizer's fake-quantized values of the trained weights (the attention linears stay
    # the student's, so only the experts are under test)
    ref, plain = copy.deepcopy(student), copy.deepcopy(student)
    for r, p in zip(ref.model.layers, plain.model.layers):
        for mod in (r.mlp.experts, p.mlp.experts):
            mod.__class__ = Qwen3MoeExperts          # its quantizers stay attached, unused
        with torch.no_grad():
            r.mlp.experts.gate_up_proj.copy_(_modelopt_nvfp4(r.mlp.experts.gate_up_proj))
            r.mlp.experts.down_proj.copy_(_modelopt_nvfp4(r.mlp.experts.down_proj))
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = student(input_ids=x).logits
        with step_cache.enabled(weights=True):          # the trainer's cached path: the same values
            cached = student(input_ids=x).logits
        want = ref(input_ids=x).logits
        unquantized = plain(input_ids=x).logits
    assert torch.equal(got, want)
    assert torch.equal(cached, want)
    # and the experts' quantization shows in the output (it is not a no-op on these weights)
    assert (got - unquantized).abs().max() > 1e-3
