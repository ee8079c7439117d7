"""The README's two quick starts and the first example of every docs/ page, run as written at CPU size.

The code blocks are read from the Markdown files themselves, so what runs is what a reader copies: a changed
example runs changed, a new command runs (and fails here if it cannot run on a CPU) until it is listed below.
Only what a CPU test must change is substituted (SUBSTITUTE, each with its reason). A command that needs a
GPU, a real model or minutes is listed in NOT_RUN with the reason, or in ELSEWHERE with the test of this suite
that runs it (that test file must still hold the command's marker).
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = shlex.quote(sys.executable)

# The commands are spelled `.venv/bin/qatfactory`, `qatfactory` or `python`; the interpreter running this test
# stands in for them (CI or a wheel's virtual environment has no .venv in the test's temporary directory).
TOOLS = ((re.compile(r"(?:^|(?<=\s))(?:\.venv/bin/)?qatfactory(?=\s)"), f"{PY} -m qatfactory.faces.cli"),
         (re.compile(r"(?:^|(?<=\s))(?:\.venv/bin/)?python(?=\s)"), PY))

# page -> [(text, replacement, why)]: only what a CPU test must change
SUBSTITUTE = {
    # a placeholder for a model folder of yours: a random 2-layer Llama with a BPE tokenizer trained here
    "README.md#python": [("/path/to/local/model", "{model}", "no real model on a CPU test machine")],
    "docs/integrations.md": [("/path/to/local/model", "{model}", "no real model on a CPU test machine")],
    # `<run>`: the run the same block trained above
    "README.md#cli": [("runs/<run>/student", "runs/tiny/student", "the placeholder names the run trained above")],
    # the gate's example names an export and a student made elsewhere: the ones README / engines.md made
    "docs/gate.md": [("out/vllm-modelopt", "out/tiny-vllm", "the export the CPU example of engines.md writes"),
                     ("runs/r/student", "runs/tiny/student", "its student")],
}

# command prefix (after the tool substitution is undone: as written) -> why it is not run here
NOT_RUN = {
    "deepspeed --num_gpus 8": "8 GPUs and a real 8B model",
    "deepspeed --num_gpus 2": "2 GPUs and a model folder of yours",
    "vllm serve": "vLLM has no CPU kernels for these formats, and a server does not exit; the GPU benchmarks load "
                  "the exports in vLLM (docs/engines.md)",
    "llama-server": "a server that does not exit; the gate runs llama.cpp's own runtime on every GGUF export",
    "qatfactory train method=grpo format=nvfp4_w4a16 model=smollm2_135m train=gpu_1x":
        "one GPU and the real SmolLM2-135M",
    "qatfactory train format=nvfp4_w4a16_kvfp8 ...": "`...`: the settings of a run of yours",
    "qatfactory train format=q4_k_kvq8_0 ...": "`...`: the settings of a run of yours",
    "make demo": "13.7 min on the real SmolLM2-135M; tests/faces/test_demo.py runs the demo's pipeline on a tiny model",
    "qatfactory demo --quick": "minutes on the real SmolLM2-135M; tests/faces/test_demo.py runs it on a tiny model",
    "qatfactory demo --model /path/to/hf_model_dir": "a model folder of yours and 100 steps per target",
    "make bench-cpu": "a benchmark (minutes): it times the emulators against libggml, its numbers are results",
    "qatfactory eval runs/<run>/student": "a real model and tokenizer (`<run>`, `<model dir>`); tests/faces/test_harness.py "
                                          "evaluates tiny students against hand computations",
    "qatfactory eval out/gguf tasks=qf_arc_easy": "your copy of ARC-Easy (`/data/...`); tests/faces/test_harness.py runs "
                                                  "the ARC task on a local file",
    "make install": "make test's own first step (Makefile: `test: install llama-cpp`)",
    "make llama-cpp": "make test's own second step (Makefile: `test: install llama-cpp`)",
}

# command prefix -> (test file of this suite that runs it, a marker that file must hold)
ELSEWHERE = {
    ".venv/bin/python -m pytest -q tests/test_import_arrows.py": ("tests/test_import_arrows.py", "def test_"),
    ".venv/bin/ruff check qatfactory exporters": ("Makefile", "$(BIN)/ruff check qatfactory exporters"),
    "python benchmarks/papers/seqlen.py --smoke": ("tests/benchmarks/test_papers_smoke.py", "def test_seqlen_smoke"),
    # the test runs the sweep's smoke mode on two of the grids (4 and 1.58 bits) to stay within seconds
    "python benchmarks/papers/paretoq_bits.py --smoke": ("tests/benchmarks/test_paretoq_papers.py", "def test_bit_sweep_smoke"),
    "LOCAL=1 bash benchmarks/gpu/scaling.sh smoke": ("tests/benchmarks/test_bench_scaling.py",
                                                     '"benchmarks/gpu/scaling.sh", "smoke"'),
    "python benchmarks/papers/scale_qlora.py --smoke": ("tests/benchmarks/test_bench_scale_qlora.py", 'sq.main(["--smoke"'),
}

# The blocks in the order they run, each in a named working directory (a later block reads what an earlier one
# of the same directory wrote: docs/reliability.md and docs/gate.md read the export of docs/engines.md).
PAGES = [("README.md#cli", "tiny"), ("docs/engines.md", "tiny"), ("docs/gate.md", "tiny"),
         ("docs/reliability.md", "tiny"), ("docs/files-and-runs.md", "tiny"), ("README.md#python", "py"),
         ("docs/training.md", "train"), ("docs/before-a-run.md", "train"), ("docs/kv-cache.md", "kv"),
         ("docs/rl.md", "rl"), ("docs/install.md", "misc"), ("docs/formats.md", "misc"),
         ("docs/architecture.md", "misc"), ("docs/benchmarks.md", "misc"), ("docs/demo.md", "misc"),
         ("docs/evaluate.md", "misc"), ("docs/long-context.md", "misc"), ("docs/low-bit.md", "misc"),
         ("docs/multi-gpu.md", "misc"), ("docs/scale-adapters.md", "misc"),
         ("docs/integrations.md", "integ")]

PASS = "verdict: PASS"
TRAIN_OK = (0, ["student: runs/tiny/student"], ["runs/tiny/student/qatfactory_quant.json"])


def _files(*paths):
    return list(paths)


# command prefix as written -> (exit code, strings its output holds, files it leaves in its directory)
EXPECT = {
    ".venv/bin/qatfactory train model=tiny_llama train=cpu_tiny method=qad format=nvfp4_w4a16 run_dir=runs/tiny":
        TRAIN_OK,
    ".venv/bin/qatfactory export runs/tiny/student --engine vllm --flavour modelopt --out out/tiny-vllm --verify":
        (0, [PASS], _files("out/tiny-vllm/config.json", "out/tiny-vllm/hf_quant_config.json")),
    ".venv/bin/qatfactory verify out/tiny-vllm --against runs/tiny/student": (0, [PASS], []),
    "qatfactory export runs/tiny/student --engine llama_cpp --out out/gguf --verify":
        (0, [PASS], _files("out/gguf/model.gguf")),
    '.venv/bin/qatfactory verify out/tiny-vllm --against runs/tiny/student; echo "exit $?"': (0, [PASS, "exit 0"], []),
    '.venv/bin/qatfactory verify out/no-such-dir --against runs/tiny/student; echo "exit $?"':
        (0, ["exit 4", "out/no-such-dir"], []),
    "QATFACTORY_DEBUG=1 .venv/bin/qatfactory verify out/no-such-dir": (4, ["out/no-such-dir", "Traceback"], []),
    ".venv/bin/qatfactory train model=tiny_llama train=cpu_tiny run_dir=runs/tiny; echo":
        (0, ["exit 4", "already holds a run", "Nothing was changed"], []),
    ".venv/bin/qatfactory train model=tiny_llama train=cpu_tiny method=qad format=nvfp4_w4a16 --cfg job":
        (0, ["name: tiny_llama", "name: qad", "save_student: true"], []),
    ".venv/bin/qatfactory train model=tiny_llama train=cpu_tiny method=qad format=nvfp4_w4a16":
        (0, ["student: runs/qad-nvfp4_w4a16-"], []),
    ".venv/bin/qatfactory train model=tiny_llama train=cpu_tiny train.lr=inf; echo":
        (0, ["exit 3", "train.lr=inf; allowed: a finite number"], []),
    ".venv/bin/qatfactory train model=tiny_llama train=cpu_tiny method=qad format=nvfp4_w4a16_kvfp8":
        (0, ["format=nvfp4_w4a16_kvfp8", "student: "], []),
    ".venv/bin/qatfactory train method=dapo train=cpu_tiny method.rl.task=say7": (0, ["eval/reward", "adapter_dir: "], []),
    ".venv/bin/qatfactory --help": (0, ["qatfactory train"], []),
    ".venv/bin/python -m qatfactory.formats": (0, ["| `nvfp4` |"], []),
}


def fenced_blocks(text):
    """(language, body) of each fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def the_block(page):
    """The block a page's reader runs first: README's two quick starts by their headings, else the page's first."""
    name, _, part = page.partition("#")
    text = (ROOT / name).read_text()
    if part:
        heading = {"cli": "## Quick start: the command line", "python": "## Quick start: Python",
                   "hf": "## Quick start: inside Hugging Face Trainer"}[part]
        assert heading in text, f"{name} lost its heading {heading!r}"
        text = text[text.index(heading):]
    blocks = fenced_blocks(text)
    assert blocks, f"{name}: no example block; every page starts with a runnable example"
    return blocks[0]


def commands(body):
    """Shell commands of a block: continuation lines joined, comment lines dropped."""
    out, cur = [], ""
    for raw in body.splitlines():
        line = raw.strip()
        if not cur and (not line or line.startswith("#")):
            continue
        cur = f"{cur} {line}" if cur else line
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        out.append(cur)
        cur = ""
    assert not cur, f"a block ends in a continuation line: {cur!r}"
    return out


def plain(cmd):
    """A command without its trailing comment and with `.venv/bin/` dropped: how the tables name it."""
    return re.sub(r"\s+#.*$", "", cmd).replace(".venv/bin/", "")


def lookup(table, cmd):
    hits = [k for k in table if plain(cmd).startswith(plain(k))]
    return table[max(hits, key=lambda k: len(plain(k)))] if hits else None


def tiny_model_folder(dst: Path):
    """A random 2-layer Llama and a byte-level BPE trained here: a model folder with a tokenizer."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_llm import tiny_llama, train_bpe
    tok = train_bpe(dst, ["Some text of yours. More of it. The quick brown fox jumps over the lazy dog."] * 20, 300)
    tiny_llama(tok, intermediate_size=128, max_position_embeddings=256).save_pretrained(dst)
    return dst


def run_shell(cmd, cwd):
    # a reader's shell has no process-group variables; a pytest worker that trained in-process holds them (and
    # its rendezvous port), and a child that inherits them joins that group instead of starting alone
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every block of PAGES run in order: {page: [(command as written, exit code, output) or (command, None,
    reason)]}; plus the README's Python quick start's model folder."""
    base = tmp_path_factory.mktemp("quickstarts")
    done, results = {}, {}
    model = tiny_model_folder(base / "model")
    for page, ws in PAGES:
        cwd = base / ws
        cwd.mkdir(exist_ok=True)
        lang, body = the_block(page)
        for old, new, _why in SUBSTITUTE.get(page, []):
            assert old in body, f"{page}: the substituted text {old!r} is gone; update SUBSTITUTE"
            body = body.replace(old, new.format(model=model))
        rows = results.setdefault(page, [])
        if lang == "python":
            (cwd / "quickstart.py").write_text(body)
            rows.append(("quickstart.py", *run_shell(f"{PY} quickstart.py", cwd)))
            continue
        assert lang in ("bash", "sh"), f"{page}: a {lang!r} block"
        for cmd in commands(body):
            if lookup(NOT_RUN, cmd) is not None:
                rows.append((cmd, None, lookup(NOT_RUN, cmd)))
                continue
            other = lookup(ELSEWHERE, cmd)
            if other is not None:
                path, marker = other
                assert marker in (ROOT / path).read_text(), f"{page}: {cmd!r} is said to run in {path}, which lost it"
                rows.append((cmd, None, f"run by {path}"))
                continue
            key = (ws, plain(cmd))
            if key in done:        # the same command in the same directory (engines.md repeats the README's)
                rows.append((cmd, *done[key]))
                continue
            shell = cmd
            for pattern, tool in TOOLS:
                shell = pattern.sub(tool, shell)
            done[key] = run_shell(shell, cwd)
            rows.append((cmd, *done[key]))
    return base, results


@pytest.mark.llama_cpp
@pytest.mark.parametrize("page", [p for p, _ in PAGES])
def test_quick_start_runs_as_written(ran, page):
    base, results = ran
    ws = dict(PAGES)[page]
    assert results[page], f"{page}: nothing in its first block"
    for cmd, rc, out in results[page]:
        if rc is None:
            continue
        if cmd == "quickstart.py":
            # README: prepare, calibrate, coverage, convert, ship; integrations.md: QADTrainer with ship: the
            # gate's verdict is printed, the export written
            assert rc == 0, out[-3000:]
            assert re.search(r"^PASS$", out, re.M), out[-3000:]
            exp = base / ws / "out" / "vllm"
            assert (exp / "config.json").is_file() and (exp / "tokenizer.json").is_file()
            continue
        want = lookup(EXPECT, cmd)
        assert want is not None, f"{page}: {cmd!r} ran but this test does not know what it promises; add it to EXPECT"
        code, says, files = want
        assert rc == code, f"{page}: {cmd!r} exit {rc} (expected {code})\n{out[-3000:]}"
        for s in says:
            assert s in out, f"{page}: {cmd!r} did not print {s!r}\n{out[-3000:]}"
        for f in files:
            assert (base / ws / f).exists(), f"{page}: {cmd!r} did not write {f}"
        if page in ("docs/training.md", "docs/before-a-run.md"):
            # one run: `--cfg job` and the refused train.lr=inf wrote nothing
            assert len(list((base / ws / "runs").iterdir())) == 1
        if "method.rl.task=say7" in cmd:
            # "learning the shaped reward": the held-out reward at the end is above the start
            start, end = map(float, re.search(r"^eval/reward\s+(\S+)\s+(\S+)$", out, re.M).groups())
            assert end > start, out[-2000:]


def test_readme_hf_trainer_block_is_the_one_integrations_md_runs():
    """README's Hugging Face Trainer quick start is docs/integrations.md's first example, character for
    character, so the run of that page above proves it (running it twice would prove nothing more)."""
    assert the_block("README.md#hf") == the_block("docs/integrations.md")


def test_every_docs_page_is_listed():
    """A new page joins PAGES (its first example runs here, or is listed as not run with the reason)."""
    listed = {p.partition("#")[0] for p, _ in PAGES}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} | {"README.md"}
    assert pages == listed, sorted(pages ^ listed)



# what third-party libraries printed on every command before our entry points filtered it (each line is one
# library's known message; a new library's line is not caught here)
NOISE = ("Failed to load ", "register_constant() on Enum", "_pytree.py", "Setting accelerator to CPU",
         "Detected no triton", "tensorboard is not installed", "fatal: not a git repository",
         "is not tested with current version of modelopt", "Loading weights")


@pytest.mark.llama_cpp
def test_commands_print_no_third_party_noise(ran):
    """`qatfactory train` on the tiny model (and export, verify, the RL and KV-cache runs) prints only ours."""
    _, results = ran
    seen = 0
    for page in ("README.md#cli", "docs/training.md", "docs/kv-cache.md", "docs/rl.md", "docs/reliability.md"):
        for cmd, rc, out in results[page]:
            if rc is None:
                continue
            seen += 1
            bad = [line for line in out.splitlines() if any(n in line for n in NOISE)]
            assert not bad, f"{page}: {cmd!r} printed:\n" + "\n".join(bad[:10])
    assert seen >= 8
