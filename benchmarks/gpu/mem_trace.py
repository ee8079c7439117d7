"""Where the LoRA-memory probe's unexplained 'other' comes from, on a GPU: the smoke model's probe of every
arm (benchmarks/papers/lora_memory.py, config ii) with torch's allocator history on, then every allocation of at
least MIN_MIB made during each probe, with its size, whether it was freed before the probe ended, and the Python
frames that asked for it. Measures nothing about LoRA; it names the allocations the parts do not count.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu/mem_trace.py      (after methods.sh preflight: data files)

Writes $OUT/mem_trace.json (OUT defaults to ./gpu_out)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
MIN_MIB = float(os.environ.get("MIN_MIB", "1"))


def py_frames(frames, n: int = 10):
    """The innermost n Python frames of an allocation, as 'file:line function' (C++ frames left out)."""
    out = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames or [] if f["filename"].endswith(".py")]
    return out[:n]


def big_allocations(snap, min_bytes: int):
    freed = set()
    events = [e for tr in snap["device_traces"] for e in tr]
    for e in events:
        if e["action"] in ("free_requested", "free_completed"):
            freed.add(e["addr"])
    return [{"action": e["action"], "mib": round(e["size"] / 2**20, 3), "stream": e.get("stream"),
             "freed_before_the_end": e["addr"] in freed, "frames": py_frames(e.get("frames"))}
            for e in events if e["action"] in ("alloc", "segment_alloc") and e["size"] >= min_bytes]


def main() -> int:
    import torch

    import lora_memory as L
    import papers_common as C
    assert torch.cuda.is_available(), "mem_trace.py needs a GPU"
    a = types.SimpleNamespace(smoke=True, model_path=None, device="cuda")
    p = L.preset(True)
    data = C.data_files(Path(tempfile.mkdtemp(prefix="qf-memtrace-")), ("wiki_train", "austen_train", "wiki_ho"),
                        p["limits"])
    out = []
    for arm in L.ARMS:
        try:                    # each arm's snapshot holds only its own probe's events
            torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=500_000,
                                                     clear_history=True)
        except TypeError:
            torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=500_000)
        r = L.probe(a, p, data, arm, p["mem"][1])
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        rec = {"arm": arm["name"], "parts_mib": {k: round(v / 2**20, 3) for k, v in r["parts"].items()},
               "measured_peak_mib": round(r["measured_peak"] / 2**20, 3), "other_mib": round(r["other"] / 2**20, 3),
               "allocations": big_allocations(snap, int(MIN_MIB * 2**20))}
        out.append(rec)
        print(f"== {rec['arm']}: peak {rec['measured_peak_mib']} MiB, other {rec['other_mib']} MiB, parts {rec['parts_mib']}")
        for b in rec["allocations"]:
            print(f"   {b['action']:13s} {b['mib']:9.3f} MiB freed={b['freed_before_the_end']} stream={b['stream']}  "
                  + " <- ".join(b["frames"][:6]))
    dest = Path(os.environ.get("OUT", "gpu_out"))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "mem_trace.json").write_text(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                                                     "min_mib": MIN_MIB, "probes": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
