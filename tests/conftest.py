import os
import sys

# One intra-op thread per test process: the emulators issue many small tensor ops, and on a
# 2-core CI machine two threads (or more processes than cores) made them up to 20x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
_HERE = os.path.dirname(os.path.abspath(__file__))
# Tests import the shared helpers that live in tests/ itself (tiny_llm, quant_helpers, ggml_oracle, ...; see
# tests/README.md) and a few test modules of a subfolder by bare name (`from test_train import BASE` in
# nn/test_lowbit_batch.py). The subfolders are not packages (pytest imports their files by basename, so every
# test file's name is unique), so the folders such imports read from are put on sys.path here, whichever file
# pytest collects first.
for _folder in ("train",        # test_train, test_compose_checks, test_train_safety, test_train_resume_ranks
                "nn",           # test_lowbit, test_weight_cache
                "exporters",    # test_exporters*, test_gguf_tokenizer, test_verify_gguf_sizes
                ""):            # tests/ first: the shared helpers
    sys.path.insert(0, os.path.join(_HERE, _folder) if _folder else _HERE)

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
