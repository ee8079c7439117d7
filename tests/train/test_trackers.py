"""train.report_to: `qatfactory train` reports to the trackers a Hugging Face Trainer would (wandb, MLflow,
TensorBoard when installed) under the names the Trainer's own tracker callbacks write (transformers'
rewrite_logs): a QAD run through either trainer shows train/loss, train/learning_rate and train/kl."""
import importlib.machinery
import json
import types

import pytest

from qatfactory.train.config import compose

BASE = ["train=cpu_tiny", "method=qad", "format=nvfp4_w4a16", "data.synthetic=8", "data.seq_len=16",
        "data.eval_samples=2", "train.eval_every=0", "train.max_steps=2", "train.save_final=false",
        "train.save_student=false"]


def stub(name, **fns):
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)   # find_spec sees it as installed
    for k, f in fns.items():
        setattr(m, k, f)
    return m


@pytest.fixture
def fake_trackers(monkeypatch):
    """wandb and mlflow stand-ins that record what they are sent (the real ones would reach a server)."""
    calls = {"wandb": [], "mlflow": [], "config": None, "closed": []}

    class Run:
        def log(self, vals, step):
            calls["wandb"].append((step, dict(vals)))

        def finish(self):
            calls["closed"].append("wandb")

    def init(**kw):
        calls["config"] = kw["config"]
        return Run()

    monkeypatch.setitem(__import__("sys").modules, "wandb", stub("wandb", init=init))
    monkeypatch.setitem(__import__("sys").modules, "mlflow", stub(
        "mlflow", start_run=lambda **kw: "run", active_run=lambda: None, log_params=lambda d: None,
        log_metrics=lambda vals, step: calls["mlflow"].append((step, dict(vals))),
        end_run=lambda: calls["closed"].append("mlflow")))
    return calls


def test_our_loop_reports_to_the_named_trackers_with_the_trainers_names(tmp_path, fake_trackers):
    from qatfactory.faces.ship import train_and_ship
    s = train_and_ship(compose(BASE + [f"run_dir={tmp_path / 'r'}", "train.report_to=[wandb,mlflow]"]))
    s.pop("engine").destroy()
    w, m = fake_trackers["wandb"], fake_trackers["mlflow"]
    assert w == m and fake_trackers["closed"] == ["wandb", "mlflow"]
    steps = {step: vals for step, vals in w if "train/loss" in vals}
    assert sorted(steps) == [1, 2]
    assert {"train/loss", "train/learning_rate", "train/kl"} <= set(steps[1])
    assert any("eval/kl" in vals and "eval/ce" in vals for _, vals in w)
    # metrics.jsonl keeps the loop's own keys and values
    recs = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in recs if r.get("step") == 1 and "loss" in r)
    assert steps[1]["train/loss"] == first["loss"] and steps[1]["train/learning_rate"] == first["lr"]
    assert fake_trackers["config"]["method"]["name"] == "qad"     # the run's settings go with it


def test_the_hf_path_writes_the_same_names():
    """What QADTrainer logs, through transformers' own renaming for its trackers, and what our loop sends."""
    from transformers.integrations.integration_utils import rewrite_logs

    from qatfactory.train.trackers import tracker_key
    hf = rewrite_logs({"loss": 0.5, "kl": 0.5, "learning_rate": 1e-5, "grad_norm": 1.0})
    ours = {tracker_key(k) for k in ("loss", "kl", "lr", "eval/kl")}
    assert {"train/loss", "train/kl", "train/learning_rate"} <= set(hf) & ours
    assert "eval/kl" in ours


def test_report_to_refusals_name_the_field(monkeypatch):
    from qatfactory.exitcodes import UsageError
    from qatfactory.train import trackers
    with pytest.raises(UsageError, match=r"train.report_to=\['foo'\]: 'foo' is not a tracker; allowed"):
        compose(BASE + ["train.report_to=[foo]"])
    monkeypatch.setattr(trackers, "installed", lambda name: False)
    with pytest.raises(UsageError, match=r"train.report_to=\['mlflow'\]: mlflow is not installed \(pip install mlflow\)"):
        compose(BASE + ["train.report_to=[mlflow]"])
    assert compose(BASE + ["train.report_to=[all]"]).train.report_to == ["all"]     # none installed: none used
    assert trackers.resolve(["all"], None) == [] and trackers.resolve(None, None) == []
