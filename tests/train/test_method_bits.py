"""The trainer's insides may move; what every built-in method computes may not. Each arm of
tests/method_bits.py (a few CPU steps per method, the step levers among them) must log the same numbers
and leave the same tensor bytes as the record tests/data/method_bits.json, taken from the trainer as it
was before it became one loop. On a machine whose torch build or CPU kernels differ from the record's,
float results may differ in the last bits: the logged numbers are then held to 1e-5 relative and the
digest is not compared (the record names its machine)."""
import json
import math

import pytest

import method_bits as MB

REC = json.loads(MB.RECORD.read_text())


@pytest.mark.parametrize("arm", sorted(MB.ARMS))
def test_same_numbers_and_bytes_as_the_record(arm, tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "method_bits"
    root.mkdir(exist_ok=True)
    got, want = MB.run_arm(arm, root), REC["arms"][arm]
    exact = MB.machine() == REC["machine"]
    assert len(got["records"]) == len(want["records"]), (got["records"], want["records"])
    for g, w in zip(got["records"], want["records"]):
        assert set(g) == set(w), (arm, sorted(set(g) ^ set(w)))
        for k in w:
            if exact:
                assert MB.same_number(g[k], w[k]), (arm, g.get("step"), k, g[k], w[k])
            else:
                assert g[k] == pytest.approx(w[k], rel=1e-5, nan_ok=True) or math.isclose(g[k], w[k], abs_tol=1e-8), \
                    (arm, g.get("step"), k, g[k], w[k])
    if exact:
        assert got["weights"] == want["weights"], arm


def test_the_record_covers_every_builtin_method():
    from qatfactory.train.methods import BUILTIN
    covered = {a.split("=", 1)[1] for arm in MB.ARMS.values() for a in arm if a.startswith("method=")}
    assert {m.name for m in BUILTIN} <= covered
    assert set(REC["arms"]) == set(MB.ARMS)
