import os
import sys

# One intra-op thread per test process: the emulators issue many small tensor ops, and on a
# 2-core CI machine two threads (or more processes than cores) made them up to 20x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))  # tests/ggml_oracle.py and other test helpers

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _environment_restored():
    """Code run in-process (benchmark mains, the GPU staging helpers) may set qatfactory's own
    variables, e.g. QATFACTORY_CACHE: every test gets them back as it found them, so none leaks into
    the next. (Only QATFACTORY_*: torch.distributed's RANK / LOCAL_RANK ... belong to the process group,
    which outlives a test.)"""
    saved = {k: v for k, v in os.environ.items() if k.startswith("QATFACTORY_")}
    yield
    for k in [k for k in os.environ if k.startswith("QATFACTORY_")]:
        if k not in saved:
            del os.environ[k]
    os.environ.update(saved)
