"""The wheel a user installs: built from this tree, installed into a fresh virtual environment outside
the checkout, and run as a user runs it (tiny train -> export --verify -> verify) from a folder that
is not the checkout."""
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# top-level folders of a working checkout that are not sources (environments, build leftovers, runs,
# staged GPU wheels): a stale build/lib in particular would put deleted files back into the wheel
_NOT_SOURCES = {"build", "dist", "runs", "outputs"}


def _copy_sources(dst: Path) -> Path:
    def ignore(folder, names):
        top = Path(folder) == ROOT
        return [n for n in names if n == "__pycache__" or
                (top and (n.startswith(".") or n in _NOT_SOURCES or n.endswith(".egg-info")))]
    shutil.copytree(ROOT, dst, ignore=ignore)
    return dst


def _build_wheel(tmp: Path) -> Path:
    src = _copy_sources(tmp / "src")
    out = tmp / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(out), "."], cwd=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("qatfactory-*.whl")
    return whl


def _clean_env(**extra) -> dict:
    """No variable that would point the installed package back at the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "QATFACTORY_RECIPES", "QATFACTORY_CSRC")}
    env.update(extra)
    return env


@pytest.mark.slow
def test_wheel_installs_outside_the_checkout_and_trains_exports_verifies(tmp_path):
    whl = _build_wheel(tmp_path)

    # -- what the wheel holds
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        meta = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"qatfactory"}, tops   # no top-level csrc/
    recipes = {p.relative_to(ROOT / "recipes").as_posix() for p in (ROOT / "recipes").rglob("*.yaml")}
    assert recipes and {"qatfactory/recipes/" + r for r in recipes} <= names
    assert {"qatfactory/csrc/" + p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh")} <= names
    # the top-level exporters/ and readers/ folders ship as qatfactory.exporters / qatfactory.readers
    for pkg in ("exporters", "readers"):
        assert {f"qatfactory/{pkg}/{p.name}" for p in (ROOT / pkg).glob("*.py")} <= names, pkg
    tasks = {p.name for p in (ROOT / "qatfactory" / "faces" / "eval_tasks").glob("*.yaml")}
    assert tasks and {"qatfactory/faces/eval_tasks/" + t for t in tasks} <= names
    assert "Requires-Python: >=3.11,<3.13" in meta.splitlines()
    core = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    # the trainer imports DeepSpeed on one process too: `pip install qatfactory` must bring it
    assert any(ln.split()[1].startswith("deepspeed") for ln in core), core

    # -- a fresh environment outside the checkout. Its dependencies (torch, transformers, DeepSpeed, the
    # gate's libraries: GBs) are not downloaded again: a .pth file appends this environment's
    # site-packages to its path. That still proves the installed package, because (1) qatfactory's own
    # files come only from the wheel: the wheel lands in the new site-packages, which is searched before
    # the appended one, and a .pth file's path line does not run the .pth files of that folder (so this
    # environment's editable-install hook, which maps qatfactory to the checkout, never loads); (2) every
    # command runs in a folder outside the checkout with PYTHONPATH unset, so the checkout is not on the
    # path; (3) qatfactory.__file__, recipes and kernel sources are asserted to resolve inside the new venv.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    new_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    (new_site / "_deps_from_test_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # pip itself comes from the appended site-packages; it installs into the new environment's prefix
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--disable-pip-version-check", str(whl)], capture_output=True, text=True, env=_clean_env())
    assert r.returncode == 0, r.stdout + r.stderr

    work = tmp_path / "user"
    work.mkdir()
    env = _clean_env(OMP_NUM_THREADS="1")

    def run(*args, exe=None):
        return subprocess.run([str(exe or venv / "bin" / "qatfactory"), *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)

    where = run("-c", "import qatfactory, qatfactory.exporters as e; from qatfactory._recipes import recipes_dir; "
                "from qatfactory.kernels.loader import csrc_dir; from qatfactory.quantize import QuantConfig; "
                "QuantConfig.preset('nvfp4_w4a16'); print(qatfactory.__file__, e.__file__, recipes_dir(), csrc_dir())",
                exe=py)
    assert where.returncode == 0, where.stderr
    for f in where.stdout.split():
        assert Path(f).resolve().is_relative_to(new_site.resolve()), (f, new_site)

    h = run("train", "--help")
    assert h.returncode == 0 and "format: " in h.stdout and "nvfp4_w4a16" in h.stdout, h.stdout + h.stderr

    t = run("train", "train=cpu_tiny", "format=nvfp4_w4a16", "train.max_steps=2", "train.eval_every=0",
            "data.synthetic=8", "data.seq_len=32", "data.eval_samples=2", "train.save_student=true", "run_dir=run")
    assert t.returncode == 0, t.stdout + t.stderr[-3000:]
    assert (work / "run" / "student").is_dir()

    e = run("export", "run/student", "--engine", "vllm", "--out", "exp", "--verify")
    assert e.returncode == 0 and "verdict: PASS" in e.stdout, e.stdout[-3000:] + e.stderr[-3000:]

    v = run("verify", "exp", "--against", "run/student", "--quiet")
    assert v.returncode == 0, v.stdout[-3000:] + v.stderr[-3000:]
    assert "verdict: PASS" in v.stdout and "0 failed" in v.stdout, v.stdout[-3000:]
