"""The LoRA adapter folder an RL run ships (what ``vllm serve --lora-modules`` loads) is gated against
the adapter the run trained: a x100 edit of one LoRA tensor, another rank or alpha, a target list that
adapts other modules, or a second weight file beside it is a FAIL naming it; the untouched folder
passes. The folder is read with peft (config, target matching) and safetensors."""
from __future__ import annotations

import json

import pytest
import torch

from qatfactory.exporters.verify.adapter import TrainedAdapter, verify_adapter


@pytest.fixture()
def adapter(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatfactory.nn import adapter as AD
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1))
    ads = AD.attach(m, 4, 8.0, ["*.q_proj", "*.v_proj"])
    with torch.no_grad():
        for a in ads.values():
            a.lora_B.normal_(0, 0.02)   # B starts at zero: make the trained adapter non-trivial
    AD.save_peft_adapter(m, str(tmp_path / "adapter"))
    trained = TrainedAdapter(4, 8.0, {n: (a.lora_A.detach().clone(), a.lora_B.detach().clone()) for n, a in ads.items()},
                             [n for n, x in m.named_modules() if isinstance(x, torch.nn.Linear)])
    return tmp_path / "adapter", trained


def _fail(v, tensor, check, *words):
    assert v.verdict == "FAIL", v.table()
    row = [c for c in v.checks if c.tensor == tensor and c.check == check]
    assert row and row[0].status == "FAIL", v.table()
    for w in words:
        assert w in row[0].detail, row[0].detail


def test_untouched_adapter_passes(adapter):
    d, trained = adapter
    v = verify_adapter(d, trained)
    assert v.verdict == "PASS", v.table()


def test_one_lora_tensor_times_100(adapter):
    from safetensors.torch import load_file, save_file
    d, trained = adapter
    sd = load_file(str(d / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    sd[key] = sd[key] * 100
    save_file(sd, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    v = verify_adapter(d, trained)
    _fail(v, key, "== trained adapter", "values differ")
    assert sum(c.status == "FAIL" for c in v.checks) == 1, v.table()


@pytest.mark.parametrize("edit,words", [({"r": 8}, "r=8 (trained: 4)"), ({"lora_alpha": 800}, "lora_alpha=800"),
                                        ({"target_modules": ["q_proj", "v_proj", "k_proj"]}, "adapts untrained"),
                                        ({"use_rslora": True}, "use_rslora=True")])
def test_edited_adapter_config(adapter, edit, words):
    d, trained = adapter
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(edit)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    _fail(verify_adapter(d, trained), "adapter_config.json", "== trained adapter", words)


def test_second_weight_file_beside_the_adapter(adapter):
    d, trained = adapter
    (d / "adapter_model.bin").write_bytes(b"not read")
    _fail(verify_adapter(d, trained), "files", "none unexpected", "adapter_model.bin")


def test_rl_run_gates_the_adapter_it_ships(tmp_path, monkeypatch):
    """method=dapo, lora_mode=adapter, export=vllm: the run's gate covers run_dir/adapter. A writer that
    scales one LoRA tensor x100 on its way to disk (as a corrupted copy would) makes the gate FAIL,
    naming the tensor, and the export is moved aside as every failed export is."""
    from safetensors.torch import load_file, save_file

    from qatfactory.nn import adapter as AD
    from qatfactory.faces.ship import train_and_ship
    from qatfactory.train.config import compose
    save = AD.save_peft_adapter

    def corrupted(model, out_dir, **kw):
        d = save(model, out_dir, **kw)
        p = f"{d}/adapter_model.safetensors"
        sd = load_file(p)
        k = sorted(x for x in sd if x.endswith("lora_A.weight"))[0]
        sd[k] = sd[k] * 100
        save_file(sd, p, metadata={"format": "pt"})
        return d
    over = ["format=nvfp4_w4a16", "train=cpu_tiny", "method.rl.task=say7", "method.rl.max_new_tokens=4",
            "method.rl.mask_truncated=false", "method.rl.lora_rank=8", "train.eval_every=0",
            "model.tiny.initializer_range=0.3", "train.lr=2e-2", "method.rl.prompts_per_step=2", "method=dapo",
            "train.max_steps=1", "train.micro_batch=16", "export=vllm", "method.rl.n_eval=0"]
    s = train_and_ship(compose(over + [f"run_dir={tmp_path / 'ok'}"]))
    s.pop("engine").destroy()
    assert s["verify_ok"] is True
    monkeypatch.setattr(AD, "save_peft_adapter", corrupted)
    s = train_and_ship(compose(over + [f"run_dir={tmp_path / 'bad'}"]))
    s.pop("engine").destroy()
    assert s["verify_ok"] is False and s["export_dir"].endswith(".FAILED"), s["verify"]
    assert any("lora_A.weight: == trained adapter: FAIL" in r for r in s["verify"]["reasons"]), s["verify"]
