"""The trainer's batched ParetoQ fake quant (nn/lowbit_batch.py) against the per-linear path (nn/lowbit.py)
and ParetoQ's released quantizer (torchao 0.18's copy, the oracle): same forward, same weight and alpha
gradients bit for bit, members of different sizes in one call (each with its own gradient scale), None
gradients for a member a pass does not use, entries that never outlive their pass, step or an in-place
write; and the host syncs of the fake quant counted (profiler: aten::_local_scalar_dense, aten::equal),
so that a per-linear .item() / bool() / torch.equal creeping back into the training path fails here."""
import pytest
import torch
from torch import nn

from qatfactory.formats import get_format
from qatfactory.nn import lowbit_batch, step_cache
from qatfactory.nn.linear import QuantLinear
from qatfactory.quantize import QuantConfig, calibrate, prepare

from test_lowbit import _released

GRIDS = ["int4_lsq", "int3_lsq_q4_0", "int2_lsq_q4_0", "int2_seq_q4_0", "ternary_seq_q4_0", "binary_sign_q4_0",
         "int4_lsq_g32"]
SYNC_OPS = ("aten::_local_scalar_dense", "aten::equal")


def _model(fmt, dtype=torch.float32, seed=0, rule="released"):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                     initializer_range=0.05))
    prepare(m, QuantConfig(weight_format=fmt, scale_strategy="learnable", calib_method="max", lowbit_grad=rule))
    calibrate(m, None, "max")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():          # alphas off their init and off the fp16 grid: the STE rounding is exercised
        for q in m.modules():
            if hasattr(q, "alpha"):
                q.alpha.mul_(0.6 + 0.5 * torch.rand(q.alpha.shape, generator=g))
    return m.to(dtype)


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _step(m, ids, batched: bool):
    """Forward + backward of a sum of the logits with weights, per-linear or batched; (logits, grads)."""
    m.zero_grad(set_to_none=True)
    with step_cache.enabled():
        if batched:
            assert lowbit_batch.register(m) == 14        # 2 layers x 7 linears
            lowbit_batch.new_pass()
        out = m(input_ids=ids).logits
        w = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
        (out * w).sum().backward()
    return out.detach(), _grads(m)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("fmt", GRIDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_equals_per_linear_bit_for_bit(fmt, dtype):
    m = _model(fmt, dtype)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    y0, g0 = _step(m, ids, batched=False)
    s0 = lowbit_batch.stats()["calls"]
    y1, g1 = _step(m, ids, batched=True)
    # 2 groups (rows of 64 and of 96 elements), one call each: not one per linear
    assert lowbit_batch.stats()["calls"] - s0 == 2
    assert torch.equal(_bits(y0), _bits(y1))
    assert g0.keys() == g1.keys() and any(k.endswith("alpha") for k in g0)
    for k in g0:
        assert torch.equal(_bits(g0[k]), _bits(g1[k])), f"{fmt} {dtype}: gradient of {k} differs"


def test_clean_ternary_rule_batched_equals_per_linear():
    m = _model("ternary_seq_q4_0", rule="clean")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    _, g0 = _step(m, ids, batched=False)
    _, g1 = _step(m, ids, batched=True)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    _, g2 = _step(_model("ternary_seq_q4_0"), ids, batched=True)     # the released rule: other alpha grads
    assert any(not torch.equal(g1[k], g2[k]) for k in g1 if k.endswith("alpha"))


class _Lins(nn.Module):
    """Linears of one row length and different output sizes (one batched call, three gradient scales)."""

    def __init__(self, fmt, rows=(8, 24, 40), k=128):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.lins = nn.ModuleList()
        for r in rows:
            lin = nn.Linear(k, r, bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(r, k, generator=g) * 0.04)
            q = QuantLinear(lin, fmt, "learnable")
            q.weight_quant.init_state(lin.weight.detach().unsqueeze(0), "max")
            with torch.no_grad():
                q.weight_quant.alpha.mul_(0.6 + 0.5 * torch.rand(q.weight_quant.alpha.shape, generator=g))
            self.lins.append(q)


@pytest.mark.parametrize("fmt", GRIDS)
def test_batched_members_equal_paretoq_released(fmt):
    """Each member's fake-quantized weight and its W and alpha gradients from the batched call equal
    ParetoQ's quantizer run on that matrix alone (its own N in g = 1/sqrt(N Qp))."""
    f = get_format(fmt)
    mods = _Lins(fmt)
    gy = [torch.randn(q.out_features, q.in_features, generator=torch.Generator().manual_seed(i))
          for i, q in enumerate(mods.lins)]
    with step_cache.enabled():
        lowbit_batch.register(mods)
        lowbit_batch.new_pass()
        c0 = lowbit_batch.stats()["calls"]
        ys = [lowbit_batch.weight(q) for q in mods.lins]
        assert lowbit_batch.stats()["calls"] - c0 == 1
        sum((y * g).sum() for y, g in zip(ys, gy)).backward()
    n = f.group or 128
    for q, y, g in zip(mods.lins, ys, gy):
        a = f.alpha_of_d(f.d_of_alpha(q.weight_quant.alpha.detach()))[0].reshape(-1, 1).clone().requires_grad_(True)
        wr = q.weight.detach().reshape(-1, n).clone().requires_grad_(True)
        yr = _released(f, wr, a)
        (yr * g.reshape(-1, n)).sum().backward()
        assert torch.equal(y, yr.reshape(y.shape))
        assert torch.equal(q.weight.grad, wr.grad.reshape(q.weight.shape))
        assert torch.equal(q.weight_quant.alpha.grad[0].reshape(-1, 1), a.grad)


def test_unused_member_gets_no_gradient_and_entries_do_not_outlive_their_pass():
    mods = _Lins("int4_lsq")
    a, b, c = mods.lins
    x = torch.randn(3, 128)
    with step_cache.enabled():
        lowbit_batch.register(mods)
        lowbit_batch.new_pass()
        (a(x).sum() + b(x).sum()).backward()             # c is in the batched call but not used
        assert c.weight.grad is None and c.weight_quant.alpha.grad is None
        assert a.weight_quant.alpha.grad is not None and b.weight.grad is not None
        # the backward consumed the entry: the same pass id recomputes rather than reuse freed outputs
        calls = lowbit_batch.stats()["calls"]
        a(x).sum().backward()
        assert lowbit_batch.stats()["calls"] == calls + 1
        # an in-place write to a member inside a pass is seen (its version counter): recomputed
        lowbit_batch.new_pass()
        y0 = lowbit_batch.weight(a).detach().clone()
        with torch.no_grad():
            a.weight.mul_(2.0)
        y1 = lowbit_batch.weight(a)
        assert lowbit_batch.stats()["calls"] == calls + 3 and not torch.equal(y0, y1)
        assert torch.equal(y1, a.quantized_weight())
        # evaluation entries (no grad) serve the step; weights_changed() ends them
        with torch.no_grad():
            e0 = lowbit_batch.weight(a)
            hits = lowbit_batch.stats()["hits"]
            assert lowbit_batch.weight(b) is not None and lowbit_batch.weight(a) is e0
            assert lowbit_batch.stats()["hits"] == hits + 2
            step_cache.weights_changed()
            assert lowbit_batch.weight(a) is not e0
        # quantization off (quant_start's full-precision phase): no longer a member
        c.quant_enabled = False
        assert lowbit_batch.weight(c) is None
    assert lowbit_batch.weight(a) is None and lowbit_batch._ATTR not in a.__dict__   # the block ended


def _scalar_reads(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name in SYNC_OPS)


@pytest.mark.parametrize("fmt", ["int4_lsq", "int2_seq_q4_0", "ternary_seq_q4_0", "binary_sign_q4_0"])
def test_host_syncs_of_the_fake_quant_are_counted(fmt):
    """A scalar read of a device tensor (.item(), bool(), float(), torch.equal) stalls the host until the
    GPU is idle. The fake quant forward + backward of n learnable linears may read one per linear outside
    the trainer (the finite check of W) and one per batched call inside it; an earlier version read
    four per linear (three of them re-checking scales d_of_alpha builds valid by construction)."""
    mods = _Lins(fmt, rows=(8, 24, 40, 16, 32))
    x = torch.randn(2, 128)

    def per_linear():
        sum(q(x).sum() for q in mods.lins).backward()

    def batched():
        with step_cache.enabled():
            lowbit_batch.register(mods)
            lowbit_batch.new_pass()
            sum(q(x).sum() for q in mods.lins).backward()

    assert _scalar_reads(per_linear) == len(mods.lins)
    assert _scalar_reads(batched) == 1
    with torch.no_grad():
        mods.lins[1].weight[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):       # the one check that stays, and says why
        batched()


# ----------------------------------------------------------------------------- in the trainer
from test_train import _losses, _run  # noqa: E402

TRAIN = ["method=qat", "format=paretoq_4bit", "model.tiny.initializer_range=0.3", "model.dtype=float32",
         "train.max_steps=3", "train.grad_accum=2", "train.eval_every=2", "train.save_student=true"]


@pytest.mark.parametrize("switch", [[], ["train.quant_start=0.5", "train.quant_lr=1e-3"]], ids=["qat", "quant_start"])
def test_trainer_batched_run_equals_the_per_linear_run(tmp_path, monkeypatch, switch):
    """Same losses, evaluations and trained student bit for bit with the batched fake quant (the default)
    and without it (train.lowbit_batch=false); gradient accumulation: one entry per micro-batch's pass; with
    quant_start, the full-precision steps first (nothing batched), the quantized ones after the switch."""
    from qatfactory.quantize import load_student
    c0 = lowbit_batch.stats()["calls"]
    a = _run(tmp_path / "batched", *TRAIN, *switch)
    calls = lowbit_batch.stats()["calls"] - c0
    # 2 groups (K = 64, 128) x (3 steps x 2 micro-batches + 3 evaluations: start, step 2, end); with the
    # switch at step 2: 1 step x 2 micro-batches + the end's evaluation (the others in full precision)
    assert calls == (2 * (6 + 3) if not switch else 2 * (2 + 1)), calls
    b = _run(tmp_path / "per_linear", *TRAIN, *switch, "train.lowbit_batch=false")
    assert lowbit_batch.stats()["calls"] - c0 == calls
    assert _losses(tmp_path / "batched") == _losses(tmp_path / "per_linear")
    assert [h["eval/ce"] for h in a["eval_history"]] == [h["eval/ce"] for h in b["eval_history"]]
    sa, sb = load_student(a["student_dir"]).model.state_dict(), load_student(b["student_dir"]).model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_ce_training_runs_no_teacher_forward(tmp_path, monkeypatch):
    """method=qat with method.eval_teacher: the teacher is run for the evaluations' KL only, not in every
    training step (its outputs were never read by the CE loss)."""
    from qatfactory.distill import teachers
    calls = []
    orig = teachers.LiveTeacher.outputs

    def counted(self, *a, **kw):
        calls.append(torch.is_grad_enabled())
        return orig(self, *a, **kw)

    monkeypatch.setattr(teachers.LiveTeacher, "outputs", counted)
    s = _run(tmp_path / "r", "method=qat", "method.eval_teacher=true", "format=paretoq_4bit", "train.max_steps=3",
             "train.eval_every=0", "data.eval_samples=4", "train.micro_batch=2")
    # two evaluations (start, end), 4 held-out samples in micro-batches of 2: 4 teacher forwards, all no-grad
    assert len(calls) == 4 and not any(calls)
    assert "eval/kl" in s["eval_last"]


def test_trainer_step_reads_one_host_scalar_per_batched_call(tmp_path):
    """The scalar reads of the quantizer code (qatfactory/nn, qatfactory/formats) per training step of a
    ParetoQ run: one per batched call (2 groups here), where a per-linear path read four per linear (56)."""
    import traceback

    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = {"step": 0, "reads": []}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith(("_local_scalar_dense", "equal")):
                files = [f.filename for f in traceback.extract_stack()]
                if any("/qatfactory/nn/" in f or "/qatfactory/formats/" in f for f in files):
                    seen["reads"].append(seen["step"])
            return func(*args, **(kwargs or {}))

    h = register_optimizer_step_post_hook(lambda *a: seen.__setitem__("step", seen["step"] + 1))
    try:
        with Count():
            _run(tmp_path / "r", "method=qat", "format=paretoq_4bit", "train.max_steps=3", "train.eval_every=0")
    finally:
        h.remove()
    per_step = [seen["reads"].count(s) for s in (1, 2)]   # steps 2 and 3 (step 1 also holds the first eval)
    assert per_step == [2, 2], seen["reads"]


def test_chunked_calls_equal_one_call(monkeypatch):
    """Members split over several batched calls (a small chunk limit) give the same bits as one call."""
    def run():
        mods = _Lins("int2_seq_q4_0", rows=(8, 24, 40, 16))
        x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
        with step_cache.enabled():
            lowbit_batch.register(mods)
            lowbit_batch.new_pass()
            c0 = lowbit_batch.stats()["calls"]
            sum((q(x) * (i + 1)).sum() for i, q in enumerate(mods.lins)).backward()
            calls = lowbit_batch.stats()["calls"] - c0
        return calls, [p.grad for p in mods.parameters()]
    one_calls, one = run()
    monkeypatch.setitem(lowbit_batch.CHUNK_ELEMS, "cpu", 40 * 128)       # 8+24 | 40 | 16 rows
    calls, chunked = run()
    assert (one_calls, calls) == (1, 3)
    assert all(torch.equal(a, b) for a, b in zip(one, chunked))
