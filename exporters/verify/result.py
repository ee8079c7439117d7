"""What the parity gate reports: one row per check, and one verdict.

    PASS        every required check ran and agreed
    FAIL        at least one check found a difference (the row names the tensor and the check)
    INCOMPLETE  nothing disagreed, but a required check could not run: a third-party tool is
                missing (the row says what to install) or the user opted out of it (--no-logits,
                llama_cpp=False). Never a pass.

Row statuses are "ok", "FAIL" and "INCOMPLETE"; there is no "skip": a check that is not run is
INCOMPLETE, so it can never be counted as agreement.
"""
from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

PASS, FAIL, INCOMPLETE = "PASS", "FAIL", "INCOMPLETE"
OK = "ok"
STATUSES = (OK, FAIL, INCOMPLETE)

# what a user installs to make each third-party check runnable
INSTALL = {
    "compressed_tensors": "pip install compressed-tensors",
    "modelopt": "pip install nvidia-modelopt",
    "gguf": "pip install gguf",
    "libggml": "pip install libggml-python",
    "llama_cpp": "pip install llama-cpp-python (or: python scripts/llama_cpp_runtime.py ensure)",
    "transformers": "pip install transformers",
    "safetensors": "pip install safetensors",
}


class Missing(Exception):
    """A third-party library a required check needs is not importable."""

    def __init__(self, module: str, why: str = ""):
        self.module = module
        self.install = INSTALL.get(module.split(".")[0], f"pip install {module.split('.')[0]}")
        super().__init__(f"{module} is not importable{(': ' + why) if why else ''}; {self.install}")


def need(module: str):
    """Import ``module`` for a required check, or raise Missing (never a silent skip)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Missing(module, str(e)) from None


class Malformed(Exception):
    """The export cannot be read far enough to compare a part of it; the message names what is wrong."""


@dataclass
class Check:
    tensor: str
    check: str
    status: str          # "ok" | "FAIL" | "INCOMPLETE"
    detail: str = ""
    max_abs_diff: Optional[float] = None
    source: str = ""     # the third-party code that produced the compared values
    install: str = ""    # INCOMPLETE rows: what to install (empty when the user opted out)


@dataclass
class VerifyResult:
    export_dir: str
    engine: str
    flavour: str
    checks: List[Check] = field(default_factory=list)
    logits: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if not self.checks or any(c.status == FAIL for c in self.checks):
            return FAIL
        if any(c.status != OK for c in self.checks):
            return INCOMPLETE
        return PASS

    @property
    def ok(self) -> bool:
        """True only for PASS."""
        return self.verdict == PASS

    @property
    def failures(self) -> List[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def incomplete(self) -> List[Check]:
        return [c for c in self.checks if c.status == INCOMPLETE]

    def to_install(self) -> List[str]:
        return sorted({c.install for c in self.checks if c.status == INCOMPLETE and c.install})

    def add(self, tensor: str, check: str, status: str, detail: str = "", max_abs_diff: Optional[float] = None,
            source: str = "", install: str = "") -> Check:
        if status not in STATUSES:
            raise ValueError(f"check status {status!r}; allowed: {STATUSES}")
        c = Check(tensor, check, status, detail, max_abs_diff, source, install)
        self.checks.append(c)
        return c

    def ok_or_fail(self, tensor: str, check: str, good: bool, detail: str = "", max_abs_diff=None,
                   source: str = "") -> bool:
        self.add(tensor, check, OK if good else FAIL, detail, max_abs_diff, source)
        return bool(good)

    def missing(self, tensor: str, check: str, err: Missing) -> None:
        self.add(tensor, check, INCOMPLETE, f"not run: {err}", install=err.install)

    def opted_out(self, tensor: str, check: str, how: str) -> None:
        self.add(tensor, check, INCOMPLETE, f"not run: opted out ({how}); the verdict can be at best INCOMPLETE")

    def table(self, width: int = 60) -> str:
        rows = [("tensor", "check", "status", "max|diff|", "detail")]
        for c in self.checks:
            d = "" if c.max_abs_diff is None else f"{c.max_abs_diff:.3g}"
            t = c.tensor if len(c.tensor) <= width else "..." + c.tensor[-(width - 3):]
            rows.append((t, c.check, c.status, d, (c.detail + (f" [{c.source}]" if c.source else ""))))
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(r[i].ljust(w[i]) for i in range(4)) + "  " + r[4] for r in rows]
        for n in self.notes:
            lines.append(f"note: {n}")
        n = {s: sum(c.status == s for c in self.checks) for s in STATUSES}
        lines.append(f"verdict: {self.verdict}  ({n[OK]} ok, {n[FAIL]} failed, {n[INCOMPLETE]} not run) "
                     f"{self.engine}/{self.flavour} {self.export_dir}")
        if self.verdict == INCOMPLETE:
            todo = self.to_install()
            # nothing to install: say which checks did not run and why (an opt-out, a missing file)
            lines.append("to complete the gate: " + ("; ".join(todo) if todo else "; ".join(
                f"{c.check} ({c.detail})" for c in self.checks if c.status == INCOMPLETE)))
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, Any]:
        return {"export_dir": self.export_dir, "engine": self.engine, "flavour": self.flavour,
                "verdict": self.verdict, "ok": self.ok, "install": self.to_install(), "notes": list(self.notes),
                "checks": [asdict(c) for c in self.checks], "logits": self.logits}
