"""The ``qatfactory`` command.

    qatfactory train method=qad format=nvfp4_w4a16 model=smollm2_135m train.max_steps=200
    qatfactory train plugins=[my.methods] method=my_sft ...   (a method registered outside the package)
    qatfactory train ... --cfg job                  (print the composed settings, run nothing)
    qatfactory eval --checkpoint runs/<run>/checkpoints/step-000200 [overrides]
    qatfactory eval <student | model dir | GGUF export> tasks=qf_gsm8k,... [limit=N]   (qatfactory.faces.eval)
    qatfactory export ... / qatfactory verify ...   (qatfactory.faces.export)
    qatfactory bench [args]                         (benchmarks/step.py)
    qatfactory demo                                 (qatfactory.faces.demo)
    qatfactory scales export|apply|extract|verify   (qatfactory.faces.scales; method=scale_adapter)

Training overrides are Hydra's (``group=option``, ``a.b=value``); recipes/ lists the options.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import runpy
import sys
from pathlib import Path
from typing import List, Optional

from .. import _quiet
from .. import exitcodes as X
from ..exitcodes import BadInputError, UsageError

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


_FILE_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


def _run_error_code(e: BaseException) -> int:
    """The exit code of an error raised inside a run: the exception's own (exitcodes), bad files
    and refused models -> BAD_INPUT, anything else -> RUN_FAILED."""
    if getattr(e, "exit_code", None) is not None or isinstance(e, KeyboardInterrupt):
        return X.code_for(e)
    from ..quantize import CoverageError  # noqa: PLC0415 (CLI start)
    if isinstance(e, _FILE_ERRORS + (CoverageError,)):
        return X.BAD_INPUT
    return X.RUN_FAILED


def _fail(prog: str, e: BaseException, code: int) -> int:
    """One line on stderr (every rank that failed; the rank named when there are several)."""
    import torch.distributed as dist  # noqa: PLC0415 (CLI start)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        prog = f"{prog} [rank {dist.get_rank()}]"
    e.exit_code = code if getattr(e, "exit_code", None) is None else e.exit_code
    return X.report(prog, e, code)


def _gate_code(summary) -> int:
    v = (summary or {}).get("verify")
    if not v or v.get("verdict") == "PASS":
        return X.OK
    return X.INCOMPLETE if v.get("verdict") == "INCOMPLETE" else X.FAIL


def _cfg_flag(argv: List[str]):
    """(argv without Hydra's ``--cfg job`` / ``--cfg=job`` / ``-c job``, whether it was there, an error)."""
    out, show, i = [], False, 0
    while i < len(argv):
        a = argv[i]
        if a in ("--cfg", "-c") or a.startswith("--cfg="):
            val = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else None)
            i += 1 if "=" in a else 2
            if val != "job":
                return argv, False, (f"--cfg {val if val is not None else '(nothing)'}: allowed: --cfg job "
                                     f"(print the composed settings and exit without running)")
            show = True
            continue
        out.append(a)
        i += 1
    return out, show, None


def _method_help(argv: List[str]) -> int:
    """The registered methods (plugins=[...] on the command line imported first), and for
    ``method=<name>`` the options it registered, one per line with type and default."""
    from ..train import methods as M  # noqa: PLC0415 (CLI start)
    from ..train.config import method_options  # noqa: PLC0415 (CLI start)
    try:
        for a in argv:
            if a.startswith("plugins="):
                M.load_plugins([x.strip() for x in a.split("=", 1)[1].strip("[]").split(",") if x.strip()])
    except ValueError as e:
        print(f"qatfactory train: USAGE: {e}", file=sys.stderr)
        return X.USAGE
    print("\nmethods (method=<name>; its own options, `qatfactory train method=<name> --help`):")
    for name, cls in M.REGISTRY.items():
        own = f"method.{cls.options_key}.*" if cls.options_key else ("method.options.*" if cls.options else "-")
        print(f"  {name}: {cls.summary} [{own}]")
    asked = [a.split("=", 1)[1] for a in argv if a.startswith("method=")]
    for name in asked:
        cls = M.REGISTRY.get(name)
        if cls is None:
            print(f"qatfactory train: USAGE: method={name}: no such method; registered: {M.method_names()}",
                  file=sys.stderr)
            return X.USAGE
        text = method_options(cls.options_key) if cls.options_key else ""
        if not text and cls.options is not None:
            text = "method.options: " + "; ".join(f.name for f in dataclasses.fields(cls.options))
        head, _, rest = (text or f"method={name}: no options of its own").partition(": ")
        print(f"\n{head}:")
        for item in rest.split("; ") if rest else []:
            print(f"  {item}")
    return 0


def train_main(argv: List[str]) -> int:
    """Exit codes (qatfactory.exitcodes): 0 done (and the export's gate PASSed), 1 the gate FAILed,
    2 INCOMPLETE, 3 a bad override, 4 a refused input, 5 the run failed; one line on stderr."""
    argv = _strip_launcher_args(list(argv))
    if any(a in ("-h", "--help") for a in argv):
        from ..train.config import recipes_dir  # noqa: PLC0415 (CLI start)
        r = recipes_dir()
        print("usage: qatfactory train [group=option ...] [key=value ...] [--cfg job]\n\n"
              "--cfg job: print the composed settings and exit without running\n\nrecipe groups:")
        for g in sorted(p for p in r.iterdir() if p.is_dir()):
            print(f"  {g.name}: {', '.join(sorted(x.stem for x in g.glob('*.yaml')))}")
        return _method_help(argv)
    argv, show, err = _cfg_flag(argv)
    if err:
        print(f"qatfactory train: USAGE: {err}", file=sys.stderr)
        return X.USAGE
    bad = [a for a in argv if a.startswith("-")]
    if bad:
        print(f"qatfactory train: USAGE: unknown option(s) {bad}; overrides are key=value (see --help)",
              file=sys.stderr)
        return X.USAGE
    try:
        from ..train.config import compose  # noqa: PLC0415 (CLI start)
        from .ship import check_request  # noqa: PLC0415 (CLI start)
        cfg = compose(argv)
        check_request(cfg)
    except BaseException as e:  # noqa: BLE001 - one line, never an 89-line traceback
        return X.report("qatfactory train", e, X.USAGE if not isinstance(e, KeyboardInterrupt) else X.INTERRUPTED)
    if show:
        # Hydra's `--cfg job`: the composed, checked settings (what the run's config.yaml would hold), no run
        from omegaconf import OmegaConf  # noqa: PLC0415 (CLI start)

        from ..train.config import to_dict  # noqa: PLC0415 (CLI start)
        print(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))), end="")
        return X.OK
    try:
        # the trainer returns its student; this face ships it (export + the parity gate)
        from .ship import train_and_ship  # noqa: PLC0415 (CLI start)
        s = train_and_ship(cfg)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, SystemExit):
            raise
        return _fail("qatfactory train", e, _run_error_code(e))
    _shutdown(s.get("engine"))
    code = _gate_code(s)
    if code != X.OK:
        v = s["verify"]
        print(f"qatfactory train: {'FAIL' if code == X.FAIL else 'INCOMPLETE'}: the parity gate said {v['verdict']} "
              f"on the export; moved to {s.get('export_dir')} (FAILED.json says why)", file=sys.stderr)
    return code


def _shutdown(engine) -> None:
    """Tear the engine and the process group down before the interpreter exits (leaving them to
    exit-time destructors sometimes aborted a launcher rank after a successful run)."""
    import torch.distributed as dist  # noqa: PLC0415 (CLI start)
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    # one process keeps its group: a later run in the same interpreter (tests, notebooks) reuses it
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()


def eval_main(argv: List[str]) -> int:
    """``qatfactory eval --checkpoint RUN/checkpoints/step-N [--out DIR] [key=value ...]``: restore the
    checkpoint and evaluate it. The result goes to ``--out`` or to the run directory that holds the
    checkpoint (found from the --checkpoint path itself, never from a path inside the checkpoint)."""
    argv = _strip_launcher_args(list(argv))
    # ---- lm-evaluation-harness on a student, a model directory or a GGUF export (qatfactory/faces/eval.py)
    if argv and not argv[0].startswith("-") and "--checkpoint" not in argv:
        return _delegate("qatfactory.faces.eval", "eval", argv)
    # ---- end
    if not argv or argv[0] in ("-h", "--help") or "--checkpoint" not in argv:
        print("usage: qatfactory eval --checkpoint RUN_DIR/checkpoints/step-N [--out DIR] [key=value ...]\n"
              "       qatfactory eval <student | model dir | GGUF export> tasks=t1,t2 [limit=N] [key=value ...]")
        return 0 if argv and argv[0] in ("-h", "--help") else X.USAGE
    opts = {}
    rest = []
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        if a in ("--checkpoint", "--out"):
            if i + 1 >= len(argv):
                print(f"qatfactory eval: USAGE: {a} needs a directory", file=sys.stderr)
                return X.USAGE
            opts[a] = argv[i + 1]
            next(it, None)
        elif a.startswith("-"):
            print(f"qatfactory eval: USAGE: unknown option {a!r}; allowed: --checkpoint, --out, key=value",
                  file=sys.stderr)
            return X.USAGE
        else:
            rest.append(a)
    path = Path(opts["--checkpoint"])
    try:
        cfg = _eval_config(path, opts.get("--out"), rest)
    except BaseException as e:  # noqa: BLE001
        return X.report("qatfactory eval", e, _run_error_code(e))
    try:
        from ..train.loop import run  # noqa: PLC0415 (CLI start)
        s = run(cfg, eval_only=True)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, SystemExit):
            raise
        return _fail("qatfactory eval", e, _run_error_code(e))
    _shutdown(s.get("engine"))
    return X.OK


def _eval_config(path: Path, out: Optional[str], rest: List[str]):
    """The RunConfig to evaluate ``path``: the checkpoint's own settings (trainer_state.json), the
    command-line overrides on top, run_dir from --out or the checkpoint's location. The input paths
    the settings name (model, data, teacher) are read only and printed; nothing is written there."""
    from omegaconf import OmegaConf  # noqa: PLC0415 (CLI start)

    from ..train import checkpoint as ckpt  # noqa: PLC0415 (CLI start)
    from ..train.config import run_schema, validate  # noqa: PLC0415 (CLI start)
    why = ckpt.incomplete(path) if path.is_dir() else f"{path} is not a directory"
    if why is not None:
        raise BadInputError(f"--checkpoint {path}: not a complete checkpoint ({why})")
    d = ckpt.read_state(path)["config"]
    # plugins are code: imported only when this command line names them, never because a file says so
    saved = list(d.get("plugins") or [])
    given = [a for a in rest if a.split("=", 1)[0].lstrip("+") == "plugins"]
    if saved and not given:
        raise UsageError(f"qatfactory eval: {path} was trained with plugins={saved} (modules that register its "
                         f"method); they run code, so they are imported only when you name them: add "
                         f"plugins=[{','.join(saved)}]")
    if not given:
        d["plugins"] = []
    # evaluation exports nothing: an export setting the checks would refuse today is not this command's business
    d["export"] = {**(d.get("export") or {}), "enabled": False}
    dd = d.get("data") or {}
    if dd.get("synthetic") and dd.get("train"):
        # a run composed when random tokens won over data.train: it trained on random tokens, evaluate on them
        d["data"] = {**dd, "train": []}
    try:
        plugins = list(OmegaConf.from_dotlist(given[-1:]).get("plugins") or []) if given else []
        if plugins:     # their methods' option blocks are part of the schema the settings are read with
            from ..train.methods import load_plugins  # noqa: PLC0415 (CLI start)
            load_plugins(plugins)
        node = OmegaConf.merge(OmegaConf.structured(run_schema(plugins)), OmegaConf.create(d),
                               OmegaConf.from_dotlist(rest))
        cfg = validate(OmegaConf.to_object(node))
    except ValueError as e:
        raise UsageError(f"qatfactory eval: {e}") from None
    except Exception as e:  # noqa: BLE001 - OmegaConf's multi-line errors
        raise UsageError(f"qatfactory eval: the checkpoint's settings with {rest}: {str(e).splitlines()[0]}") from None
    if out is None:
        if path.parent.name != "checkpoints":
            raise UsageError(f"--checkpoint {path} is not inside a <run>/checkpoints/ directory; give --out DIR for "
                             f"the result")
        out = str(path.parent.parent)
    cfg.run_dir = out
    cfg.resume = str(path)
    cfg.export.enabled = False
    cfg.export.out_dir = None
    reads = {k: v for k, v in (("model.path", cfg.model.path), ("method.teacher_path", cfg.method.teacher_path),
                               ("method.teacher_cache", cfg.method.teacher_cache),
                               ("data.train", list(cfg.data.train) or None), ("data.eval", list(cfg.data.eval) or None))
             if v}
    if reads:
        print(f"[qatfactory] eval: reading (never writing) {reads} as the checkpoint's settings say; override "
              f"them with key=value", file=sys.stderr, flush=True)
    return cfg


def _delegate(module: str, what: str, argv: List[str]) -> int:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        print(f"qatfactory {what}: BAD_INPUT: {module} is not available in this installation ({e})", file=sys.stderr)
        return X.BAD_INPUT
    rc = mod.main(argv)
    return int(rc or 0)


def bench_main(argv: List[str]) -> int:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "step.py"     # qatfactory/faces/ -> the checkout
    if not script.exists():
        print(f"qatfactory bench: BAD_INPUT: {script} not found (benchmarks ship with the source tree)",
              file=sys.stderr)
        return X.BAD_INPUT
    sys.argv = [str(script)] + list(argv)
    runpy.run_path(str(script), run_name="__main__")
    return 0


COMMANDS = {
    "train": train_main,
    "eval": eval_main,
    "export": lambda a: _delegate("qatfactory.faces.export", "export", ["export"] + a),
    "verify": lambda a: _delegate("qatfactory.faces.export", "verify", ["verify"] + a),
    "bench": bench_main,
    "demo": lambda a: _delegate("qatfactory.faces.demo", "demo", a),
    # scale adapters: merge / swap / roll back scale files (qatfactory.faces.scales)
    "scales": lambda a: _delegate("qatfactory.faces.scales", "scales", a),
}


def main(argv: Optional[List[str]] = None) -> int:
    """Exit codes: qatfactory.exitcodes (docs/reliability.md)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet.install()
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return X.OK if argv else X.USAGE
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"qatfactory: USAGE: unknown command {cmd!r}; allowed: {sorted(COMMANDS)}", file=sys.stderr)
        return X.USAGE
    return COMMANDS[cmd](rest)


if __name__ == "__main__":
    sys.exit(main())
