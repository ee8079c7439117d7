"""The Python API (qatfactory.api, re-exported lazily by `import qatfactory`): quantize a loaded model for a
format recipe, train it with any loop (Distiller: the trainer's own loss), ship it through the parity gate;
errors name the CLI's field and what is allowed."""
import copy
import json
import subprocess
import sys

import pytest
import torch

import qatfactory as qf
from qatfactory.exitcodes import UsageError


def tiny(seed=0, vocab=259):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                        initializer_range=0.3))


def test_import_stays_light_and_names_load_on_use():
    code = ("import sys, qatfactory as qf\n"
            "assert 'torch' not in sys.modules and 'qatfactory.api' not in sys.modules, sorted(sys.modules)[:20]\n"
            "assert {'quantize_model', 'ship', 'Distiller', 'save', 'load'} <= set(dir(qf))\n"
            "print('OK')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]
    # on first use the names are qatfactory.api's
    assert qf.quantize_model.__module__ == "qatfactory.api" and qf.ship is qf.api.ship
    assert set(qf._API) <= set(qf.api.__all__)
    with pytest.raises(AttributeError, match="no_such_name"):
        qf.no_such_name      # noqa: B018


def test_quantize_train_ship_in_a_few_lines(tmp_path):
    """The flow of the docs: quantize + calibrate, a few steps of a plain torch loop on the Distiller's loss,
    ship: the export's gate PASSes, the student saved with its format state loads back with the same logits."""
    model = tiny()
    teacher = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 259, (2, 16), generator=g) for _ in range(3)]
    qf.quantize_model(model, "nvfp4_w4a16", calib=[d[0] for d in data])
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "QuantLinear"
    d = qf.Distiller(teacher)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in data * 3:
        loss = d(model, ids, torch.ones_like(ids), labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses
    s = qf.ship(model, "vllm", out=str(tmp_path / "out"))
    assert s.ok is True and s.gate["verdict"] == "PASS" and (tmp_path / "out" / "config.json").is_file()
    qf.save(model, tmp_path / "student")
    back = qf.load(tmp_path / "student")
    with torch.no_grad():
        assert torch.equal(back(data[0]).logits, model(data[0]).logits)
    assert json.loads((tmp_path / "student" / "qatfactory_quant.json").read_text())["quant_config"]["name"] == \
        "nvfp4_w4a16"
    # a student folder ships as the CLI's `qatfactory export STUDENT` does; an occupied --out needs force
    with pytest.raises(FileExistsError, match="force"):
        qf.ship(str(tmp_path / "student"), "vllm", out=str(tmp_path / "out"))
    again = qf.ship(str(tmp_path / "student"), "vllm", out=str(tmp_path / "out"), force=True, verify=False)
    assert again.ok is None and (tmp_path / "out" / "config.json").is_file()


def test_distiller_loss_is_the_trainers_bit_for_bit():
    """Distiller.loss, called on the model or through a wrapper after install, is the loss train/student.py's
    StudentLM computes in `qatfactory train` (same ops, same bits, same gradients); labels of -100 drop tokens."""
    from qatfactory.distill.losses import LossConfig
    from qatfactory.train.student import StudentLM
    model, teacher = tiny(0), tiny(1)
    qf.quantize_model(model, "nvfp4_w4a16")
    ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0
    labels = ids.masked_fill(attn == 0, -100)
    labels[0, :4] = -100                                      # a prompt that does not count
    mask = labels != -100
    d = qf.Distiller(teacher, temperature=2.0)
    cfg = LossConfig(kind="forward_kl", temperature=2.0)
    with d.teacher_outputs(ids, attn) as t:
        ref = StudentLM(model, cfg).default_loss(ids, attn, mask, t)
    ref.backward()
    gref = model.model.layers[0].mlp.up_proj.weight.grad.clone()
    model.zero_grad()
    got = d.loss(model, ids, attn, labels)
    got.backward()
    assert torch.equal(got, ref) and torch.equal(model.model.layers[0].mlp.up_proj.weight.grad, gref)
    model.zero_grad()

    class Wrapper(torch.nn.Module):       # what DDP / a DeepSpeed engine do: call the module's forward
        def __init__(self, m):
            super().__init__()
            self.module = m

        def forward(self, *a, **kw):
            return self.module(*a, **kw)

    d.install(model)
    assert torch.equal(d.loss(Wrapper(model), ids, attn, labels), ref)
    with torch.no_grad():                 # any other call is the model's own forward
        assert model(ids).logits.shape == (2, 12, 259)
    # CE (QAT): no teacher; -100 labels do not count, the rest are the targets
    ce = qf.Distiller(None, "ce")
    full = ce.loss(model, ids, None, ids)
    part = ce.loss(model, ids, None, labels)
    assert torch.isfinite(full) and not torch.equal(full, part)


@pytest.mark.parametrize("call, says", [
    (lambda m: qf.quantize_model(m, "xyz"), "format=xyz: no such recipe; allowed: ['mxfp4_gguf'"),
    (lambda m: qf.quantize_model(m, "bf16"), "format=bf16: no such recipe (bf16 quantizes nothing)"),
    (lambda m: qf.quantize_model(m, "nvfp4_w4a16", scale_strategy="sometimes"), "scale_strategy"),
    (lambda m: qf.quantize_model(m, "nvfp4_w4a16", nonsense=1), "quant: unknown field(s) ['nonsense']"),
    (lambda m: qf.ship(m, "vllm", out="x"), "the model is not quantized"),
    (lambda m: qf.ship(m, "trt", out="x"), "--engine trt: allowed: ['llama_cpp', 'sglang', 'vllm']"),
    (lambda m: qf.ship(qf.quantize_model(m), "vllm"), "--out: required"),
    (lambda m: qf.Distiller(None), "method.loss.kind='forward_kl' distills from a teacher"),
    (lambda m: qf.Distiller(m, temperature=0), "method.loss.temperature=0; allowed: a number > 0"),
])
def test_errors_name_the_cli_field(call, says):
    with pytest.raises(UsageError) as e:
        call(tiny())
    assert says in str(e.value), str(e.value)


def test_already_quantized_is_refused():
    m = qf.quantize_model(tiny())
    with pytest.raises(UsageError, match="already quantized"):
        qf.quantize_model(m)


def test_a_teacher_folder_or_a_missing_one(tmp_path):
    """teacher= a model folder is loaded (no remote code) and frozen: the same loss as the model given itself;
    a folder that is not there is named."""
    teacher = tiny(1)
    teacher.save_pretrained(tmp_path / "teacher")
    model = qf.quantize_model(tiny(0))
    ids = torch.randint(0, 259, (2, 8), generator=torch.Generator().manual_seed(5))
    a = qf.Distiller(teacher).loss(model, ids)
    b = qf.Distiller(str(tmp_path / "teacher")).loss(model, ids)
    assert torch.equal(a, b)
    assert not any(p.requires_grad for p in qf.Distiller(str(tmp_path / "teacher")).teacher_module.parameters())
    with pytest.raises(FileNotFoundError, match="nowhere.*is not a directory"):
        qf.Distiller(str(tmp_path / "nowhere"))
