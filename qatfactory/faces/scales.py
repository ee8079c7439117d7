"""`qatfactory scales`: merge, swap and roll back the scale files of method=scale_adapter (qatfactory.faces.cli delegates).

    qatfactory scales export  --base BASE --scales run/scales.safetensors --engine vllm --flavour compressed-tensors --out OUT
    qatfactory scales apply   --base BASE --scales task.scales.safetensors --out OUT     # same container, only scale bytes change
    qatfactory scales extract BASE --out base.scales.safetensors                          # a checkpoint's own scales (rollback)
    qatfactory scales verify  OUT --base BASE --scales FILE

BASE is the native NVFP4/MXFP4 checkpoint the adapter trained on (model.path of the run); a scale file
applies only onto the base it was trained on (it records each tensor's code SHA-256 and per-tensor scale),
and only with bytes its layout can hold, inside the trust region it trained under (native.py). ``export``
writes the base's codes with the file's scale bytes for any engine through the exporters; ``apply`` copies the base
and overwrites its scale bytes (every other tensor byte is the base's): the task swap. Rollback = apply
the base's own scales (``extract``). Every written checkpoint goes through the parity gate and its
code-plane hook (codes == the base's); one that does not PASS is moved to ``OUT.FAILED`` (FAILED.json
inside), like every failed export. Exit codes: 0 PASS, 1 FAIL, 2 INCOMPLETE, 3 USAGE, 4 BAD_INPUT.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import qatfactory.exitcodes as X
from qatfactory._fsutil import check_replaceable

from .export import _print_result, verdict_code


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qatfactory scales", description="scale files of method=scale_adapter")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="the base's codes + a scale file's bytes, for an engine, verified")
    e.add_argument("--base", required=True)
    e.add_argument("--scales", required=True)
    e.add_argument("--engine", required=True, choices=["vllm", "sglang", "llama_cpp"])
    e.add_argument("--flavour", "--flavor", default=None)
    e.add_argument("--out", required=True)
    e.add_argument("--force", action="store_true", help="replace an earlier export of ours (never anything else)")
    a = sub.add_parser("apply", help="the base with its scale bytes replaced by the file's (same container)")
    a.add_argument("--base", required=True)
    a.add_argument("--scales", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--force", action="store_true")
    x = sub.add_parser("extract", help="a native checkpoint's own scale bytes as a scale file (the rollback)")
    x.add_argument("base")
    x.add_argument("--out", required=True)
    v = sub.add_parser("verify", help="gate + code-plane hook of a checkpoint against base + scale file")
    v.add_argument("export_dir")
    v.add_argument("--base", required=True)
    v.add_argument("--scales", required=True)
    v.add_argument("--no-logits", action="store_true")
    for q in (e, a, v):
        q.add_argument("--quiet", action="store_true")
    return p


def _gate(out, ck, cm, args, written: bool = False) -> int:
    """The gate and its code-plane hook on ``out``. ``written``: this command wrote ``out``, so a verdict
    other than PASS moves it to ``<out>.FAILED`` with FAILED.json, as every failed export is marked."""
    from qatfactory.exporters import verify  # noqa: PLC0415 (CLI start)
    from qatfactory.exporters.verify.code_plane import check_code_plane  # noqa: PLC0415 (CLI start)
    from qatfactory.faces.ship import gate_summary, mark_failed  # noqa: PLC0415 (CLI start)
    res = verify(out, cm, logits=not getattr(args, "no_logits", False))
    check_code_plane(res, out, ck.path, cm)
    _print_result(res, getattr(args, "quiet", False))
    if written and res.verdict != "PASS":
        moved = mark_failed(out, gate_summary(res))
        print(f"the parity gate said {res.verdict}: {out} was moved to {moved} (FAILED.json inside); do not serve it")
    return verdict_code(res)


def _run(args) -> int:
    from .. import native as N  # noqa: PLC0415 (CLI start)
    if args.cmd == "extract":
        ck = N.read_native(args.base)
        meta = N.base_scale_file(ck, args.out)
        print(f"wrote {args.out}: the scale bytes of {ck.path} ({ck.container} {ck.layout}), code plane "
              f"{meta['base_code_plane_sha256'][:16]}...")
        return 0
    ck = N.read_native(args.base)
    tensors, meta = N.load_scale_file(args.scales, ck)
    cm = N.converted_with_scales(ck, tensors, meta.get("format") or None)
    if args.cmd == "export":
        from qatfactory.exporters import export  # noqa: PLC0415 (CLI start)
        check_replaceable(args.out, ("export",), "export", [args.base])
        r = export(cm, args.out, engine=args.engine, flavour=args.flavour, force=args.force)
        print(f"exported {r.engine}/{r.flavour} -> {r.path} (codes of {ck.path}, scales of {args.scales})")
        return _gate(r.path, ck, cm, args, written=True)
    if args.cmd == "apply":
        r = N.write_patched(args.base, args.scales, args.out, force=args.force)
        print(f"applied {args.scales} onto {ck.path} -> {args.out}: {r['scale_bytes_changed']} scale bytes changed, "
              f"code plane {r['code_plane_sha256'][:16]}... kept")
        return _gate(args.out, ck, cm, args, written=True)
    return _gate(args.export_dir, ck, cm, args)


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return X.OK if e.code in (0, None) else X.USAGE
    try:
        return _run(args)
    except KeyboardInterrupt as e:
        return X.report(f"qatfactory scales {args.cmd}", e)
    except (FileExistsError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
            NotImplementedError, ValueError, TypeError, KeyError) as e:
        return X.report(f"qatfactory scales {args.cmd}", e, X.BAD_INPUT)
    except Exception as e:  # noqa: BLE001
        return X.report(f"qatfactory scales {args.cmd}", e, X.RUN_FAILED)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
