"""benchmarks/accuracy/peer_{llmcompressor,autoround}.py in smoke mode (a tiny random Llama on CPU; they measure
nothing, they run every code path of the GPU runs: the peer's own quantization and exporter in its own process,
the export read back through transformers + compressed-tensors, the shared evaluator), the independent export
check of peer_export_check.py (and that it fails on a tampered export), and the merge of the peers' JSONs into
qad_recipe.py's table.

llm-compressor 0.14 pins transformers <= 5.17 and compressed-tensors 0.19, so it cannot live in this project's
environment: its smoke runs in ``.venv-peer-llmc`` (see peer_llmcompressor.py) and skips, naming how to build it,
where that venv is absent. AutoRound installs beside the project (the test and bench extras)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.optional_imports import needed

REPO = Path(__file__).resolve().parents[2]
ACC = REPO / "benchmarks" / "accuracy"
sys.path.insert(0, str(ACC))
sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
import peer_export_check as X  # noqa: E402
import qad_recipe as R  # noqa: E402

pytestmark = pytest.mark.slow
LLMC_PY = REPO / ".venv-peer-llmc" / "bin" / "python"


def _env(**extra):
    # this worker may have run a trainer in its own process: its process-group variables (and the port its
    # store still listens on) must not reach a child, whose own launcher (accelerate, DeepSpeed) would reuse them
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(extra)
    return env


def _llmc_python() -> str:
    if not LLMC_PY.is_file() or subprocess.run([str(LLMC_PY), "-c", "import llmcompressor"],
                                               capture_output=True).returncode != 0:
        pytest.skip(f"llm-compressor cannot be installed beside this project's pins; its smoke needs {LLMC_PY}: "
                    "python3 -m venv .venv-peer-llmc && .venv-peer-llmc/bin/python -m pip install torch==2.13.0 "
                    "llmcompressor==0.14.0.1")
    return str(LLMC_PY)


def _smoke(script: str, out: Path, tag: str, *args: str) -> dict:
    env = _env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, str(ACC / f"{script}.py"), "--smoke", "--out", str(out), "--steps", "2",
                        "--tag", tag, "--work", str(out / f"w-{tag}"), *args], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, f"{script}: {r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return json.loads((out / f"{tag}.json").read_text())


@pytest.fixture(scope="module")
def llmc(tmp_path_factory):
    py = _llmc_python()
    out = tmp_path_factory.mktemp("llmc")
    return out, _smoke("peer_llmcompressor", out, "llmc", "--peer-python", py)


@pytest.fixture(scope="module")
def autoround(tmp_path_factory):
    needed("auto_round")
    out = tmp_path_factory.mktemp("autoround")
    return out, _smoke("peer_autoround", out, "ar")


def _ct_config(export: str) -> dict:
    return json.loads((Path(export) / "config.json").read_text())["quantization_config"]


def _assert_scored_and_checked(row: dict) -> None:
    assert "error" not in row, row
    for held in R.HELD:
        assert math.isfinite(row[held]["kl"]) and row[held]["kl"] > 0
    chk = row["export_check"]
    assert chk["ok"] and chk["own_eq_ct"] and chk["off_grid"] == 0, chk
    # every packed Linear was compared with the peer's own fake-quantized weight
    assert chk["modules"] > 0 and chk["peer_checked"] == chk["modules"], chk


def test_llmcompressor_rows_come_from_its_compressed_tensors_exports(llmc):
    _, res = llmc
    assert res["peer_version"] == "0.14.0.1"
    nv = res["ptq"]["llm-compressor NVFP4A16"]
    gptq = next(v for k, v in res["ptq"].items() if k.startswith("llm-compressor GPTQ W4A16"))
    for row in (nv, gptq):
        _assert_scored_and_checked(row)
        assert row["export_check"]["config_ok"]
        assert _ct_config(row["export"])["quant_method"] == "compressed-tensors"
    assert nv["export_check"]["format"] == "nvfp4-pack-quantized" and nv["export_check"]["group_size"] == 16
    assert not nv["export_check"]["input_activations"]
    assert gptq["export_check"]["format"] == "pack-quantized" and gptq["export_check"]["group_size"] == 64
    assert nv["calib"].startswith("data-free") and gptq["calib"]["windows"] > 0
    # the peer ran under its own pins, not this project's
    assert nv["peer_record"]["versions"]["compressed-tensors"] == "0.19.0"


def test_autoround_row_comes_from_its_llm_compressor_export(autoround):
    _, res = autoround
    ((name, row),) = res["ptq"].items()
    assert name.startswith("auto-round NVFP4 act_bits=16")
    _assert_scored_and_checked(row)
    assert row["export_check"]["format"] == "nvfp4-pack-quantized"
    assert row["settings"]["iters"] == 2 and row["calib"]["windows"] == 4
    # the arm quantizes weights only: the check says whether the export's config says so too
    assert row["export_check"]["config_ok"] == (not _ct_config(row["export"]).get("config_groups", {})
                                                .get("group_0", {}).get("input_activations"))


def test_export_check_fails_on_a_tampered_export(llmc, tmp_path):
    _, res = llmc
    from safetensors.torch import load_file, save_file
    row = res["ptq"]["llm-compressor NVFP4A16"]
    qdq = Path(row["peer_record"]["peer_qdq"])
    assert X.check(Path(row["export"]), qdq)["ok"]
    for key, how in (("weight_packed", "codes"), ("weight_scale", "scales")):
        bad = tmp_path / how
        shutil.copytree(row["export"], bad)
        sd = load_file(str(bad / "model.safetensors"))
        name = next(k for k in sorted(sd) if k.endswith(key))
        t = sd[name].clone()
        if key == "weight_packed":
            t.view(-1)[0] ^= 0x07          # another E2M1 magnitude in the first element
        else:
            t = (t.float() / 2).to(t.dtype)  # every block of the first Linear at half its scale
        sd[name] = t
        save_file(sd, str(bad / "model.safetensors"))
        r = X.check(bad, qdq)
        assert r["own_eq_ct"] and not r["ok"] and r["peer_max_rel"] > 0.01, (how, r)


def test_own_decoder_agrees_with_compressed_tensors_on_every_layout(llmc):
    _, res = llmc
    for row in res["ptq"].values():
        chk = X.check(Path(row["export"]))
        assert chk["own_eq_ct"] and chk["own_vs_ct_max"] == 0.0, chk


def test_merge_puts_both_peers_in_one_table(llmc, autoround, tmp_path):
    (lo, _), (ao, _) = llmc, autoround
    out = tmp_path / "merged"
    assert R.main(["--merge", str(lo / "llmc.json"), str(ao / "ar.json"), "--out", str(out)]) == 0
    m = json.loads((out / "qad_recipe.json").read_text())
    assert {"llm-compressor NVFP4A16"} <= set(m["ptq"]) and any(k.startswith("auto-round") for k in m["ptq"])
    md = (out / "qad_recipe.md").read_text()
    assert "PTQ llm-compressor NVFP4A16" in md and "PTQ auto-round NVFP4" in md


def test_a_peer_that_fails_is_a_row_saying_why_and_a_failed_exit(tmp_path):
    # the worker's interpreter exits at once: no export, so no score may be made up
    env = _env(OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(ACC / "peer_autoround.py"), "--smoke", "--out", str(tmp_path), "--steps",
                        "2", "--tag", "bad", "--work", str(tmp_path / "w"), "--peer-python", shutil.which("false")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    ((name, row),) = json.loads((tmp_path / "bad.json").read_text())["ptq"].items()
    assert "worker" in row["error"] and "exit 1" in row["error"] and "wiki_ho" not in row
    assert "auto-round NVFP4" in (tmp_path / "bad.md").read_text()
