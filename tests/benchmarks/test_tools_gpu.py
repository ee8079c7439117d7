"""tools/gpu (the logistics of a GPU machine without network access) beside the benchmark runners in
benchmarks/gpu: each runner finds the modules it needs there by itself, from any working directory, and the
copy engines.sh starts SGLang's background warm-up from keeps the layout the runners look for."""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _py(code: str, cwd: Path) -> subprocess.CompletedProcess:
    # only the runners' own folder on the path (as `python benchmarks/gpu/X.py` gets it), not tools/gpu
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks' / 'gpu')!r}); "
                           + code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_runners_find_the_logistics_in_tools_gpu(tmp_path):
    tools = str(REPO / "tools" / "gpu")
    r = _py("import sglang_jit, carry_plan; print(carry_plan.__file__); "
            "assert sglang_jit.sha256 is carry_plan.sha256", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(Path(tools) / "carry_plan.py")
    # part 2 of the pipeline imports staging at its top (torch and transformers with it: a few seconds)
    r = _py("import part2_smollm2, staging; print(staging.__file__); "
            "assert part2_smollm2.setup_assets is staging.setup_assets", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == str(Path(tools) / "staging.py")


def test_nothing_is_left_behind_in_benchmarks_gpu():
    for name in ("stage.sh", "staging.py", "carry_plan.py", "unpack_results.py", "run.sh"):
        assert (REPO / "tools" / "gpu" / name).is_file(), name
        assert not (REPO / "benchmarks" / "gpu" / name).exists(), name


def test_the_background_warm_up_copy_keeps_the_layout(tmp_path):
    """engines.sh copies the files SGLang's warm-up needs to /tmp/qf-sgwarm (the next device call replaces
    the working tree meanwhile); sglang_jit.py there must import the copied carry_plan.py."""
    text = (REPO / "benchmarks" / "gpu" / "engines.sh").read_text()
    body = text[text.index("sglang_warm() {"):]
    body = body[:body.index("setsid ")]
    lines = [ln.strip() for ln in body.splitlines() if re.match(r"\s*(rm -rf|mkdir|cp) .*/tmp/qf-sgwarm", ln)]
    assert len(lines) >= 2, body
    copy = tmp_path / "qf-sgwarm"
    script = "set -e\n" + "\n".join(ln.replace("/tmp/qf-sgwarm", str(copy)) for ln in lines) + "\n"
    r = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for rel in ("tools/gpu/stage.sh", "tools/gpu/carry_plan.py", "benchmarks/gpu/engines.py",
                "benchmarks/gpu/engines_sglang.py", "benchmarks/gpu/sglang_jit.py"):
        assert (copy / rel).is_file(), rel
    r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import sglang_jit, "
                        "carry_plan; print(carry_plan.__file__)", str(copy / "benchmarks" / "gpu")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(copy / "tools" / "gpu" / "carry_plan.py")
