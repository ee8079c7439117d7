"""`qatfactory train ... --cfg job` (Hydra's convention): the composed settings printed, nothing run."""
import subprocess
import sys

import yaml

from qatfactory.faces.cli import main


def test_cfg_job_prints_the_composed_settings_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["train", "model=tiny_llama", "train=cpu_tiny", "format=q4_k", "train.lr=3e-4", f"run_dir={tmp_path}/r",
               "--cfg", "job"])
    out = capsys.readouterr().out
    assert rc == 0
    cfg = yaml.safe_load(out)          # the whole output is the YAML a run's config.yaml holds
    assert cfg["model"]["name"] == "tiny_llama" and cfg["quant"]["weight_format"] == "q4_k_m"  # the recipe q4_k is the Q4_K_M policy
    assert cfg["train"]["lr"] == 3e-4 and cfg["run_dir"] == f"{tmp_path}/r"
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()


def test_cfg_job_spellings_and_refusals(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--cfg=job", "model=tiny_llama"]) == 0
    assert "name: tiny_llama" in capsys.readouterr().out
    assert main(["train", "--cfg", "hydra"]) == 3           # Hydra's other parts have no meaning here
    assert "--cfg hydra: allowed: --cfg job" in capsys.readouterr().err
    assert main(["train", "--cfg"]) == 3
    assert main(["train", "--cfg", "job", "train.lr=inf"]) == 3   # settings are checked as for a run
    assert "train.lr=inf; allowed: a finite number" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_cfg_job_through_the_launcher_module(tmp_path):
    p = subprocess.run([sys.executable, "-m", "qatfactory.train", "model=tiny_llama", "--cfg", "job"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "name: tiny_llama" in p.stdout and not any(tmp_path.iterdir())
