"""`qatfactory export` and `qatfactory verify` (qatfactory.faces.cli delegates both here).

    qatfactory export STUDENT --engine vllm --flavour modelopt --out OUT [--force]
    qatfactory export STUDENT --engine llama_cpp --out OUT [--dense-dtype bf16]
    qatfactory verify OUT --against STUDENT [--no-logits] [--no-llama-cpp] [--json report.json]

STUDENT is a directory written by ``quantize.save_student``; it is rebuilt with
``load_student`` and turned into plain tensors with ``convert`` (this module sits at the cli
level, so it may import quantize; the exporters never do). Exit codes (qatfactory.exitcodes):
0 PASS, 1 FAIL, 2 INCOMPLETE (a required check could not run: the message says what to install,
or it was opted out of), 4 BAD_INPUT (no such export / student, or an export the engine cannot
load was refused), 3 USAGE.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

import qatfactory.exitcodes as X
from qatfactory._fsutil import NotOursError, check_replaceable, write_text_atomic


def load_converted(student: str, source_dir: Optional[str] = None):
    """ConvertedModel of a save_student directory (source_dir overrides where the tokenizer,
    generation config and chat template are copied from)."""
    from qatfactory.quantize import convert, load_student  # noqa: PLC0415 (CLI start)
    from qatfactory.quantize.io import recorded_source  # noqa: PLC0415 (CLI start)

    if not os.path.isdir(student):
        raise FileNotFoundError(f"student directory {student!r} does not exist (expected a save_student output)")
    model = load_student(student)
    cm = convert(model)
    if source_dir is not None:
        if not os.path.isdir(source_dir):
            raise FileNotFoundError(f"--source-dir {source_dir!r} does not exist")
        cm.source_dir = source_dir
    else:
        # the model folder the student recorded, else tokenizer files saved beside the student
        src, why = recorded_source(student)
        if why:
            print(f"note: {why}; give --source-dir to copy the tokenizer from elsewhere", file=sys.stderr)
        cm.source_dir = src or student
    return cm


def _parser() -> argparse.ArgumentParser:
    from qatfactory.exporters import list_exporters  # noqa: PLC0415 (CLI start)

    p = argparse.ArgumentParser(prog="qatfactory", description="export a trained student / verify an export")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write a checkpoint an engine loads as is")
    e.add_argument("student", help="save_student directory")
    e.add_argument("--engine", required=True, choices=list_exporters())
    e.add_argument("--flavour", "--flavor", default=None,
                   help="vllm/sglang: modelopt | compressed-tensors (default modelopt); llama_cpp: gguf")
    e.add_argument("--out", required=True, help="output directory (written atomically)")
    e.add_argument("--force", action="store_true",
                   help="replace an earlier export of ours (its qatfactory.json) or an empty directory; never "
                        "anything else (a user directory, a run, the student itself)")
    e.add_argument("--source-dir", default=None,
                   help="base model dir for tokenizer/generation config/chat template (default: the model folder "
                        "the student recorded, when it is still that model)")
    e.add_argument("--dense-dtype", default="auto", choices=["auto", "f32", "f16", "bf16"],
                   help="llama_cpp: type of unquantized 2-D tensors (norms/routers are always F32)")
    e.add_argument("--max-shard-gb", type=float, default=5.0, help="vllm/sglang: safetensors shard size")
    e.add_argument("--verify", action="store_true",
                   help="run the parity gate right after exporting (one that does not PASS moves the export to "
                        "OUT.FAILED with FAILED.json inside)")
    v = sub.add_parser("verify", help="reload an export with third-party code and compare it with the student")
    v.add_argument("export_dir")
    v.add_argument("--against", required=True, help="save_student directory the export was made from")
    v.add_argument("--no-logits", action="store_true",
                   help="skip the logits comparisons (bytes and weights only); the verdict is then INCOMPLETE at best")
    v.add_argument("--no-llama-cpp", action="store_true",
                   help="GGUF: skip llama.cpp's own runtime (required otherwise); the verdict is then INCOMPLETE at best")
    v.add_argument("--llama-cpp", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    v.add_argument("--source-dir", default=None,
                   help="base model dir the export copied tokenizer/generation config/chat template from (as for export)")
    v.add_argument("--json", default=None, help="also write the structured result here")
    v.add_argument("--quiet", action="store_true", help="print failures and the verdict only")
    return p


def _print_result(res, quiet: bool) -> None:
    if quiet:
        lines = res.table().splitlines()
        keep = [ln for ln in lines[1:] if "  FAIL  " in ln or "  INCOMPLETE  " in ln or
                ln.startswith(("verdict:", "to complete", "note:"))]
        print("\n".join([lines[0]] + keep))
    else:
        print(res.table())


def main(argv: Optional[List[str]] = None) -> int:
    """Exit codes (qatfactory.exitcodes): 0 success / parity PASS, 1 parity FAIL, 2 INCOMPLETE,
    3 a bad command line, 4 refused input (missing or damaged files, an output that is not ours to
    replace, a combination the engine cannot load), 5 anything else; the reason on stderr, one line."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:      # argparse: --help exits 0, a bad command line 2 -> USAGE
        return X.OK if e.code in (0, None) else X.USAGE
    try:
        return _run(args)
    except KeyboardInterrupt as e:
        return X.report(f"qatfactory {args.cmd}", e)
    except (FileExistsError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
            NotImplementedError, ValueError, TypeError, KeyError) as e:
        return X.report(f"qatfactory {args.cmd}", e, X.BAD_INPUT)
    except Exception as e:  # noqa: BLE001 - one line and an exit code, never an uncaught traceback
        return X.report(f"qatfactory {args.cmd}", e, X.RUN_FAILED)


def verdict_code(res) -> int:
    return {"PASS": X.OK, "FAIL": X.FAIL, "INCOMPLETE": X.INCOMPLETE}[res.verdict]


def _run(args) -> int:
    from qatfactory.exporters import verify  # noqa: PLC0415 (CLI start)
    from qatfactory.faces.ship import ship  # noqa: PLC0415 (CLI start)

    if args.cmd == "export":
        # refused before the student is even loaded: an output that is not ours, or that is (or
        # holds) the student the export is made from
        check_replaceable(args.out, ("export",), "export", [args.student, args.source_dir])
        cm = load_converted(args.student, args.source_dir)
        opts = {}
        if args.engine == "llama_cpp":
            opts["dense_dtype"] = args.dense_dtype
        else:
            opts["max_shard_bytes"] = int(args.max_shard_gb * 2**30)
        r = ship(cm, args.engine, args.flavour, args.out, verify=args.verify, force=args.force, **opts)
        print(f"exported {r.engine}/{r.flavour} -> {args.out} ({', '.join(r.files)})")
        kv = r.record.get("kv_cache")   # the cache type the student was trained for
        if kv:
            att = kv.get("attention") or "none"
            how = f" and vLLM {kv.get('attention_backend')}'s FP8 attention ({att})" if att != "none" else ""
            print(f"KV cache: trained for {kv['format']}{how}; serve it with {kv['serve_flags']}")
        if args.verify:
            _print_result(r.report, quiet=False)
            if not r.ok:
                print(f"the parity gate said {r.gate['verdict']}: the export was moved to {r.path} (FAILED.json "
                      f"inside); do not serve it")
            return verdict_code(r.report)
        return 0
    if not os.path.isdir(args.export_dir):
        raise FileNotFoundError(f"export directory {args.export_dir!r} does not exist")
    if args.json:       # refused before the gate runs: nothing is computed for a report that cannot be written
        check_report_path(args.json, [args.export_dir, args.against, args.source_dir])
    cm = load_converted(args.against, args.source_dir)
    res = verify(args.export_dir, cm, logits=not args.no_logits, llama_cpp=not args.no_llama_cpp)
    _print_result(res, args.quiet)
    if args.json:       # again, with the model folder the student's record named (its tokenizer was compared)
        check_report_path(args.json, [args.export_dir, args.against, args.source_dir, cm.source_dir])
        write_text_atomic(args.json, json.dumps({REPORT_KEY: 1, **res.to_dict()}, indent=2) + "\n")
    return verdict_code(res)


REPORT_KEY = "qatfactory_verify_report"     # marks a --json report as ours: only such a file is replaced


def check_report_path(path, folders) -> None:
    """Refuse a ``--json`` path that would replace anything but an earlier report of ours (a student's
    record, a user's file, a link) or that lies inside the export or student it reports on (which would
    change the folders the gate compares). Exit codes: 4 for a file in the way, 3 for a path inside."""
    p = os.path.abspath(path)
    for d in folders:
        if d is not None and os.path.isdir(d):
            root = os.path.realpath(d)
            if os.path.commonpath([os.path.realpath(os.path.dirname(p)), root]) == root:
                raise X.UsageError(f"--json {path}: inside {d}, a folder this report is about; a report is never "
                                   f"written into the export or the student. Give a path outside them")
    if os.path.islink(p) or (os.path.exists(p) and not os.path.isfile(p)):
        raise NotOursError(f"--json {path}: a symbolic link or not a file; it is not replaced. Nothing was "
                           f"changed: give another path")
    if os.path.exists(p):
        try:
            with open(p) as f:
                d = json.load(f)
            ours = isinstance(d, dict) and REPORT_KEY in d
        except (OSError, ValueError, TypeError):
            ours = False
        if not ours:
            raise NotOursError(f"--json {path}: exists and is not a qatfactory verify report (no "
                               f"{REPORT_KEY!r}); only an earlier report is replaced. Nothing was changed: remove "
                               f"it yourself or give another path")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
