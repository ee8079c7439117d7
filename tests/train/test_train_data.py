"""Data: text / jsonl / chat with prompt masking, packing, padding, deterministic resumable order; CLI."""
import json

import pytest
import torch

from qatfactory.train.data import (ByteTokenizer, DataConfig, Order, build_samples, load_data, rank_batch,
                                   synthetic_samples)

TOK = ByteTokenizer()


def test_text_packing(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.txt").write_text("second doc!")
    s = build_samples([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], TOK, DataConfig(seq_len=8))
    flat = list(b"hello world") + [257] + list(b"second doc!") + [257]
    assert len(s) == len(flat) // 8
    assert s.input_ids.flatten().tolist() == flat[:len(s) * 8]
    assert bool(s.mask.all()) and bool((s.attn == 1).all())


def test_chat_jsonl_masks_the_prompt(tmp_path):
    rec = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4"}]}
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps(rec) + "\n" + json.dumps({"text": "plain"}) + "\n")
    s = build_samples([str(p)], TOK, DataConfig(seq_len=64, pack=False))
    ids, m, a = s.input_ids[0], s.mask[0], s.attn[0]
    n = int(a.sum())
    text = TOK.decode(ids[:n].tolist())
    assert text == "<|system|>\nbe brief\n<|user|>\n2+2?\n<|assistant|>\n4\n"
    trained = TOK.decode(ids[m].tolist())
    assert trained == "4\n"                                   # only the assistant's answer is a target
    assert not bool(m[n:].any()) and int(ids[n]) == TOK.pad_token_id   # padding: no attention, no loss
    assert bool(s.mask[1, :5].all()) and TOK.decode(s.input_ids[1, :5].tolist()) == "plain"


def test_bad_inputs_are_named(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{nope\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        build_samples([str(p)], TOK, DataConfig(seq_len=4))
    q = tmp_path / "q.jsonl"
    q.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"neither 'text' nor 'messages'"):
        build_samples([str(q)], TOK, DataConfig(seq_len=4))
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_info.json").write_text("{}")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install datasets"):
            build_samples([str(tmp_path / "ds")], TOK, DataConfig(seq_len=4))
    (tmp_path / "short.jsonl").write_text('{"text": "ab"}\n')
    with pytest.raises(ValueError, match="do not fill one sample"):
        build_samples([str(tmp_path / "short.jsonl")], TOK, DataConfig(seq_len=4))
    with pytest.raises(ValueError, match="seq_len"):
        DataConfig(seq_len=1)


def test_order_is_deterministic_resumable_and_split_by_rank():
    s = synthetic_samples(10, 8, 50, seed=0)
    o1, o2 = Order(10, 7), Order(10, 7)
    assert o1.take(0, 25) == o2.take(0, 25)
    assert sorted(o1.take(0, 10)) == list(range(10)) and sorted(o1.take(10, 10)) == list(range(10))
    assert o1.take(0, 10) != o1.take(10, 10)                  # a new permutation each epoch
    assert Order(10, 7).take(13, 5) == o1.take(0, 18)[13:]    # resume from a position
    r0 = rank_batch(s, Order(10, 7), 4, 2, 0, 2)["sample_ids"].tolist()
    r1 = rank_batch(s, Order(10, 7), 4, 2, 1, 2)["sample_ids"].tolist()
    assert r0 + r1 == o1.take(4, 4)


def test_held_out_eval_is_the_tail(tmp_path):
    (tmp_path / "t.txt").write_text("abcdefgh" * 20)
    tr, ev = load_data(DataConfig(train=[str(tmp_path / "t.txt")], seq_len=16, eval_samples=3), TOK, 259, 0)
    assert len(ev) == 3 and len(tr) == 10 - 3
    assert torch.equal(ev.input_ids[-1], build_samples([str(tmp_path / "t.txt")], TOK,
                                                       DataConfig(seq_len=16)).input_ids[-1])


def test_cli(capsys, monkeypatch):
    from qatfactory.faces import cli
    assert cli.main(["nope"]) == 3                   # exitcodes.USAGE
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert cli._strip_launcher_args(["--local_rank=1", "a=b", "--local_rank", "1", "c=d"]) == ["a=b", "c=d"]
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "method: " in out and "qad_lora" in out and "nvfp4_w4a16" in out
    assert cli.main(["train", "--bogus"]) == 3
    import importlib
    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "qatfactory.faces.export":
            raise ImportError("No module named 'qatfactory.faces.export'")
        return real(name, *a, **k)
    monkeypatch.setattr(importlib, "import_module", fake)
    assert cli.main(["export", "x"]) == 4            # exitcodes.BAD_INPUT: not installed
    assert "qatfactory.faces.export is not available" in capsys.readouterr().err


def test_lr_schedules():
    import math
    from qatfactory.train.config import TrainConfig
    from qatfactory.train.runtime import lr_lambda
    const = lr_lambda(TrainConfig(schedule="constant", warmup_steps=0, max_steps=10))
    assert [const(s) for s in (0, 5, 9)] == [1.0, 1.0, 1.0]
    cos = lr_lambda(TrainConfig(schedule="cosine", warmup_steps=4, max_steps=14, min_lr_ratio=0.1))
    assert [cos(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(14) == pytest.approx(0.1) and cos(100) == pytest.approx(0.1)


def test_uniform_random_tokens_exclude_special_ids_and_eval_on_real_text(tmp_path):
    """data.synthetic_kind=uniform (the QAD report's random-token data): ids uniform over the vocabulary
    minus the tokenizer's special tokens, different per seed; data.eval files are the held-out set."""
    (tmp_path / "ho.txt").write_text("held out text " * 20)
    cfg = DataConfig(synthetic=400, synthetic_kind="uniform", seq_len=64, eval=[str(tmp_path / "ho.txt")])
    tr, ev = load_data(cfg, TOK, 259, seed=3)
    assert tr.input_ids.shape == (400, 64)
    ids = tr.input_ids.flatten()
    assert int(ids.max()) == 255 and int(ids.min()) == 0            # 256 BOS, 257 EOS, 258 PAD never drawn
    counts = torch.bincount(ids, minlength=256).double()
    n = ids.numel() / 256
    chi2 = float(((counts - n) ** 2 / n).sum())
    assert chi2 < 400                                               # 255 dof: mean 255, sd ~23
    assert ev.input_ids[0, :14].tolist() == list(b"held out text ")
    tr2, _ = load_data(cfg, TOK, 259, seed=4)
    assert not torch.equal(tr.input_ids, tr2.input_ids)
    assert torch.equal(load_data(cfg, TOK, 259, seed=3)[0].input_ids, tr.input_ids)
    # the structured kind keeps its synthetic held-out tail when no eval files are given
    tr3, ev3 = load_data(DataConfig(synthetic=10, eval_samples=2, seq_len=16), TOK, 259, seed=0)
    assert torch.equal(torch.cat([tr3.input_ids, ev3.input_ids]), synthetic_samples(12, 16, 259, 0).input_ids)
    with pytest.raises(ValueError, match="synthetic_kind='normal'; allowed"):
        DataConfig(synthetic=2, synthetic_kind="normal")
