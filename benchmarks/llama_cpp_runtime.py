"""llama.cpp's own runtime on every GGUF cell of the supported matrix: how close its logits come to the
student's, with and without the Q8 activation rounding emulated (the numbers in the README matrix).

    .venv/bin/python benchmarks/llama_cpp_runtime.py          # prints a table and the MEASURED dict

Each cell's tiny student (tests/test_exporters_helpers.py) is exported and verified with the real
gate; the numbers are the gate's own (VerifyResult.logits["llama.cpp"]). Paste the dict into
exporters/matrix.py (MEASURED, with MEASURED_ON) and regenerate the README section with
``python -m qatfactory.exporters.matrix``.
"""
from __future__ import annotations

import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    from test_exporters_helpers import cell_student

    from qatfactory.exporters import export, verify
    from qatfactory.exporters.matrix import CELLS

    rows, measured = [], {}
    t0 = time.time()
    for c in CELLS:
        if c.engine != "llama_cpp":
            continue
        cm = cell_student(c)
        with tempfile.TemporaryDirectory() as d:
            export(cm, Path(d) / "g", engine="llama_cpp")
            v = verify(Path(d) / "g", cm)
        r = v.logits.get("llama.cpp") or {}
        rows.append((c.id, v.verdict, r.get("kl_best"), r.get("kl_max"), r.get("plain_kl_max"), r.get("max_rel"),
                     r.get("plain_max_rel"), r.get("kl_q8_effect_max"), r.get("ambiguous_roundings")))
        if r:
            exact = sum(k < 1e-12 for k in r["kl_per_prompt"])
            print(c.id, "per prompt KL", ["%.1e" % k for k in r["kl_per_prompt"]], "tipping",
                  ["%.1e" % k for k in r["kl_tipped_per_prompt"]], "Q8", ["%.1e" % k for k in r["kl_q8_per_prompt"]])
            measured[c.id] = (exact, len(r["kl_per_prompt"]), float(f"{r['kl_max']:.2g}"),
                              float(f"{r['plain_kl_max']:.2g}"), float(f"{r['max_rel_first_prompt']:.2g}"))
    print(f"{'cell':48s} verdict  KL(best)  KL(worst) KL(plain) rel(emu)  rel(plain) Q8-eff-KL n-tied")
    for cid, verdict, *xs in rows:
        f = (lambda x: "-" if x is None else f"{x:.2g}")
        print(f"{cid:48s} {verdict:8s} " + " ".join(f"{f(x):9s}" for x in xs))
    print(f"\n{len(rows)} cells in {time.time() - t0:.0f} s on {platform.processor() or platform.machine()}")
    print("\nMEASURED = {")
    for k, v in measured.items():
        print(f"    {k!r}: {v},")
    print("}")
    return 0 if all(r[1] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
