"""The ``qatfactory`` command.

    qatfactory train method=qad format=nvfp4_w4a16 model=smollm2_135m train.max_steps=200
    qatfactory eval --checkpoint runs/<run>/checkpoints/step-000200 [overrides]
    qatfactory export ... / qatfactory verify ...   (qatfactory.cli_export)
    qatfactory bench [args]                         (benchmarks/step.py)
    qatfactory demo                                 (qatfactory.demo)

Training overrides are Hydra's (``group=option``, ``a.b=value``); recipes/ lists the options.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import List, Optional

USAGE = __doc__


def _strip_launcher_args(argv: List[str]) -> List[str]:
    """The deepspeed launcher appends --local_rank=N; the env var LOCAL_RANK says the same."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a.startswith("--local_rank=") or a.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
            continue
        if a in ("--local_rank", "--local-rank"):
            if i + 1 < len(argv):
                os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            skip = True
            continue
        out.append(a)
    return out


def train_main(argv: List[str]) -> int:
    argv = _strip_launcher_args(list(argv))
    if any(a in ("-h", "--help") for a in argv):
        from .train.config import recipes_dir
        r = recipes_dir()
        print("usage: qatfactory train [group=option ...] [key=value ...]\n\nrecipe groups:")
        for g in sorted(p for p in r.iterdir() if p.is_dir()):
            print(f"  {g.name}: {', '.join(sorted(x.stem for x in g.glob('*.yaml')))}")
        return 0
    bad = [a for a in argv if a.startswith("-")]
    if bad:
        print(f"qatfactory train: unknown option(s) {bad}; overrides are key=value (see --help)", file=sys.stderr)
        return 2
    from .train.config import compose
    from .train.engine import run
    s = run(compose(argv))
    _shutdown(s.get("engine"))
    return 0


def _shutdown(engine) -> None:
    """Tear the engine and the process group down before the interpreter exits (leaving them to
    exit-time destructors sometimes aborted a launcher rank after a successful run)."""
    import torch.distributed as dist
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def eval_main(argv: List[str]) -> int:
    argv = _strip_launcher_args(list(argv))
    if not argv or argv[0] in ("-h", "--help") or "--checkpoint" not in argv:
        print("usage: qatfactory eval --checkpoint RUN_DIR/checkpoints/step-N [key=value ...]")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    i = argv.index("--checkpoint")
    if i + 1 >= len(argv):
        print("qatfactory eval: --checkpoint needs a directory", file=sys.stderr)
        return 2
    path = Path(argv[i + 1])
    rest = argv[:i] + argv[i + 2:]
    import json
    from omegaconf import OmegaConf
    from .train.config import RunConfig, validate
    from .train.engine import run
    state_p = path / "trainer_state.json"
    if not state_p.exists():
        print(f"qatfactory eval: {state_p} not found", file=sys.stderr)
        return 2
    d = json.loads(state_p.read_text())["config"]
    node = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(d), OmegaConf.from_dotlist(rest))
    cfg = validate(OmegaConf.to_object(node))
    cfg.resume = str(path)
    run(cfg, eval_only=True)
    return 0


def _delegate(module: str, what: str, argv: List[str]) -> int:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        print(f"qatfactory {what}: {module} is not available in this installation ({e})", file=sys.stderr)
        return 2
    rc = mod.main(argv)
    return int(rc or 0)


def bench_main(argv: List[str]) -> int:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "step.py"
    if not script.exists():
        print(f"qatfactory bench: {script} not found (benchmarks ship with the source tree)", file=sys.stderr)
        return 2
    import runpy
    sys.argv = [str(script)] + list(argv)
    runpy.run_path(str(script), run_name="__main__")
    return 0


COMMANDS = {
    "train": train_main,
    "eval": eval_main,
    "export": lambda a: _delegate("qatfactory.cli_export", "export", ["export"] + a),
    "verify": lambda a: _delegate("qatfactory.cli_export", "verify", ["verify"] + a),
    "bench": bench_main,
    "demo": lambda a: _delegate("qatfactory.demo", "demo", a),
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"qatfactory: unknown command {cmd!r}; allowed: {sorted(COMMANDS)}", file=sys.stderr)
        return 2
    return COMMANDS[cmd](rest)


if __name__ == "__main__":
    sys.exit(main())
