"""train/levers.py: every training performance lever is switched by a train.* config field, never by the
environment, inside the run's scope only (undone after it); a bad value is refused with exit 3 naming the
field. The bits each lever computes are tests/train/test_method_bits.py's and each lever's own test's."""
from __future__ import annotations

import types

import pytest
import torch
from test_compose_checks import _refused
from test_train import BASE
from transformers import LlamaConfig, LlamaForCausalLM

from qatfactory import exitcodes as X
from qatfactory import kernels
from qatfactory.exitcodes import UsageError
from qatfactory.nn import fake_quant as FQ
from qatfactory.nn import kquant_refresh, lean_act, lowbit_batch, step_cache, weight_cache
from qatfactory.quantize import QuantConfig, calibrate, prepare
from qatfactory.train.config import RunConfig
from qatfactory.train.levers import Levers
from tests.quant_helpers import ids, tiny


def _cfg(**train) -> RunConfig:
    cfg = RunConfig()
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def _step(m):
    m(input_ids=ids(), labels=ids()).loss.backward()


@pytest.mark.parametrize("on", [True, False])
def test_weight_cache_field(on):
    m = tiny("llama")
    prepare(m, QuantConfig.preset("nvfp4_w4a16"))
    weight_cache.reset_stats()
    with Levers(_cfg(weight_cache=on), training=True) as lv:
        lv.install(m)
        assert step_cache.weights_cached() is on
        _step(m)
        _step(m)
    st = weight_cache.stats()
    assert (st["fills"] > 0 and st["hits"] > 0) if on else st["fills"] == st["hits"] == 0, st
    assert step_cache.current() is None                      # the scope ended: nothing cached after the run


@pytest.mark.parametrize("mode", ["always", "never", "auto"])
def test_weight_cache_batch_field(mode):
    before = weight_cache.set_batching("never")
    try:
        with Levers(_cfg(weight_cache_batch=mode), training=True):
            assert weight_cache.batching() == mode
        assert weight_cache.batching() == "never"             # the caller's own setting is back
    finally:
        weight_cache.set_batching(before)


def _paretoq():
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2))
    prepare(m, QuantConfig(weight_format="int4_lsq", scale_strategy="learnable", calib_method="max"))
    calibrate(m, None, "max")
    return m


@pytest.mark.parametrize("on,grad_ckpt", [(True, False), (False, False), (True, True)])
def test_lowbit_batch_field(on, grad_ckpt):
    m = _paretoq()
    q = m.model.layers[0].self_attn.q_proj
    with Levers(_cfg(lowbit_batch=on, grad_ckpt=grad_ckpt), training=False) as lv:
        lv.install(m)
        lv.attach(None, 1)          # no lean step when not training: the engine is not touched
        c0 = lowbit_batch.stats()["calls"]
        lv.forward()
        _step(m)
        calls = lowbit_batch.stats()["calls"] - c0
        assert (lowbit_batch._ATTR in q.__dict__) is (on and not grad_ckpt)
    assert calls == (2 if on and not grad_ckpt else 0)       # two groups: K = 64 (q..up), K = 96 (down)
    assert lowbit_batch._ATTR not in q.__dict__                # unregistered when the run ends


@pytest.mark.parametrize("on", [True, False])
def test_lean_act_field(on):
    m = tiny("llama")
    with Levers(_cfg(lean_act=on), training=True) as lv:
        n = lv.install(m)
        patched = [x for x in m.modules() if getattr(x, lean_act._LEAN, False)]
        assert bool(patched) is on and n["norms"] == (5 if on else 0)     # 2 layers x 2 + the final norm
    assert not any(getattr(x, lean_act._LEAN, False) for x in m.modules())   # undone after the run


@pytest.mark.parametrize("lean_step,training", [(True, True), (False, True), (True, False)])
def test_lean_step_field(lean_step, training):
    engine = types.SimpleNamespace(optimizer=None, enable_backward_allreduce=True, zero_optimization=lambda: False)
    with Levers(_cfg(lean_step=lean_step), training=training) as lv:
        done = lv.attach(engine, 1)
    assert engine.enable_backward_allreduce is not (lean_step and training)
    assert bool(done) is (lean_step and training)


def test_nvfp4_kernel_field_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("QF_NVFP4_KERNEL", "v1")       # what a benchmark outside the trainer may set
    for v in ("v2", "v2x", "auto"):
        with Levers(_cfg(nvfp4_kernel=v), training=True):
            assert kernels.nvfp4_kernel_version() == v
    assert kernels.nvfp4_kernel_version() == "v1"      # outside the run the override applies again


def test_kquant_rule_only_inside_a_step():
    """quant.kquant_refresh_every: the kept-scale rule is installed into the core quantizer only for the
    length of Levers.step (the search runs on step 0, the kept scales serve step 1), never outside."""
    m = tiny("llama", hidden=256, inter=256, layers=1)
    prepare(m, QuantConfig(weight_format="q4_k", kquant_refresh_every=2))
    with Levers(_cfg(), training=True) as lv:
        lv.install(m)
        kquant_refresh.reset_stats()
        for s in (0, 1):
            with lv.step(s):
                assert FQ._STEP_RULE["rule"] is kquant_refresh.forward
                with torch.no_grad():
                    m(input_ids=ids())
            assert FQ._STEP_RULE["rule"] is None
        st = kquant_refresh.stats()
        assert st["searches"] > 0 and st["kept"] == st["searches"], st


@pytest.mark.parametrize("field,value", [("weight_cache_batch", "sometimes"), ("nvfp4_kernel", "v3"),
                                         ("weight_cache", "maybe"), ("lowbit_batch", 2)])
def test_levers_refuse_a_bad_value_naming_the_field(field, value):
    with pytest.raises(UsageError, match=f"train.{field}="):
        Levers(_cfg(**{field: value}), training=True)


@pytest.mark.parametrize("over,text", [("train.weight_cache_batch=sometimes", "train.weight_cache_batch='sometimes'"),
                                       ("train.nvfp4_kernel=v3", "train.nvfp4_kernel='v3'"),
                                       ("train.weight_cache=maybe", "train.weight_cache"),
                                       ("train.lowbit_batch=maybe", "train.lowbit_batch")])
def test_cli_refuses_a_bad_lever_value_with_usage(capsys, tmp_path, over, text):
    _refused(capsys, tmp_path, BASE + [over], X.USAGE, text)
