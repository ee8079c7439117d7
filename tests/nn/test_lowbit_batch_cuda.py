"""The batched ParetoQ fake quant on the GPU (run on the H200 with ``pytest -m cuda``): the trainer's one call
per group gives each member's fake-quantized weight and its W and alpha gradients with the bits of the
per-linear call. On a CPU tests/nn/test_lowbit_batch.py proves it; here the question is CUDA's row-sum
reduction, whose launch configuration depends on the number of rows: the alpha gradient sums each row
over the same K elements in both paths, and this test says whether CUDA orders them the same way."""
import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from torch import nn  # noqa: E402

from qatfactory.nn import lowbit_batch, step_cache  # noqa: E402
from qatfactory.nn.linear import QuantLinear  # noqa: E402

# SmolLM2-135M's linears of one layer: q, k, v, o, gate, up (K = 576) and down (K = 1536)
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def _members(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    mods = nn.ModuleList()
    for r, k in SHAPES:
        lin = nn.Linear(k, r, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(r, k, generator=g) * 0.04)
        q = QuantLinear(lin, fmt, "learnable")
        q.weight_quant.init_state(lin.weight.detach().unsqueeze(0), "max")
        with torch.no_grad():
            q.weight_quant.alpha.mul_(0.6 + 0.5 * torch.rand(q.weight_quant.alpha.shape, generator=g))
        mods.append(q)
    return mods.to("cuda", dtype)


@pytest.mark.parametrize("fmt", ["int4_lsq", "int3_lsq_q4_0", "int2_seq_q4_0", "ternary_seq_q4_0", "binary_sign_q4_0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_equals_per_linear_on_cuda(fmt, dtype):
    gys = [torch.randn(r, k, generator=torch.Generator().manual_seed(i)).to("cuda", dtype)
           for i, (r, k) in enumerate(SHAPES)]

    def run(batched):
        mods = _members(fmt, dtype)
        with step_cache.enabled():
            if batched:
                assert lowbit_batch.register(mods) == len(SHAPES)
                lowbit_batch.new_pass()
            ys = [lowbit_batch.weight(q) if batched else q.quantized_weight() for q in mods]
            sum((y.float() * g.float()).sum() for y, g in zip(ys, gys)).backward()
        return ([y.detach() for y in ys], [q.weight.grad for q in mods], [q.weight_quant.alpha.grad for q in mods])

    ref, got = run(False), run(True)
    for what, a, b in zip(("forward", "weight gradient", "alpha gradient"), ref, got):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{fmt} {dtype}: {what} of member {i} {SHAPES[i]} differs " \
                                      f"({int((x != y).sum())} elements)"
