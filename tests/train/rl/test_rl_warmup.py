"""The supervised warm-up before RL (train/rl/warmup.py, train/rl/rewards.py): its data never shares a
question with an RL training pool or held-out set, its targets score full marks, its loss is the
cross-entropy of the target tokens only (checked against an unpadded, unbatched computation), a tiny
warm-up makes a random model follow the answer format, and the calibration refuses a model that is
never right."""
import re
from pathlib import Path

import pytest
import torch

from qatfactory.train.rl import rewards as R


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _pools(seeds, n_train, n_eval):
    """The RL runs' questions, read straight from make_task (not through arith_questions)."""
    out = {}
    for s in seeds:
        for lv in range(len(R.ARITH_LEVELS)):
            t = R.make_task("arith", "tag", lv, n_train=n_train, n_eval=n_eval, seed=s)
            out[(s, lv, "train")] = {i.question for i in t.train}
            out[(s, lv, "eval")] = {i.question for i in t.eval}
    return out


def test_warmup_data_never_overlaps_the_rl_prompts_or_eval_items():
    seeds, n_train, n_eval = [0, 1], 1000, 256
    pools = _pools(seeds, n_train, n_eval)
    items = R.arith_warmup(1400, None, 0, R.arith_questions(seeds, n_train, n_eval))
    qs = [i.question for i in items]
    assert len(set(qs)) == len(qs) == 1400
    for key, pool in pools.items():
        assert pool.isdisjoint(qs), key
    # the levels are taken in turn, and the filter is what keeps them apart: level 0 has only
    # 2,000 distinct questions, so an unfiltered draw from the warm-up's own stream collides
    n_lv = len(R.ARITH_LEVELS)
    for k, (steps, _, _) in enumerate(R.ARITH_LEVELS):
        assert {i.question.count(".") for i in items[k::n_lv]} == {1 + steps}, k
    raw = R.arith_warmup(400, [0], 0, ())
    assert not pools[(0, 0, "train")].isdisjoint(i.question for i in raw)
    # the calibration prompts (RL pool of seed 0, one held-out item) are inside what is excluded
    cal = R.make_task("arith", "tag", 3, n_train=128, n_eval=1, seed=0)
    assert {i.question for i in cal.train} <= R.arith_questions([0], n_train, n_eval)
    with pytest.raises(ValueError, match="could not draw 3000 problems at levels \\[0\\]"):
        R.arith_warmup(3000, [0], 0, R.arith_questions(seeds, n_train, n_eval))


@pytest.mark.parametrize("fmt", R.ANSWER_FORMATS)
def test_warmup_targets_score_full_marks_and_their_steps_add_up(fmt):
    task = R.make_task("arith", fmt, 0, n_train=1, n_eval=1)
    for it in R.arith_warmup(70, None, 5, ()):
        text = R.target_text(it, fmt)
        assert task.score(text, it) == {"reward": 2.2, "correct": 1.0, "format": 1.0}, text
        # an independent reading of the worked steps: each "a op b = c." holds and chains on
        steps = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)\.", it.solution)
        assert steps and int(steps[-1][3]) == int(it.gold)
        for k, (a, op, b, c) in enumerate(steps):
            a, b, c = int(a), int(b), int(c)
            assert c == (a + b if op == "+" else a - b if op == "-" else a * b)
            if k:
                assert a == int(steps[k - 1][3])
        assert int(steps[0][0]) == int(re.search(r"has (\d+) ", it.question).group(1))
        # a wrong final number is not correct
        bad = R.Item(it.question, str(int(it.gold) + 1), it.solution)
        assert task.score(R.target_text(bad, fmt), it)["correct"] == 0.0
    with pytest.raises(ValueError, match="no worked solution"):
        R.target_text(R.Item("q", "1"), fmt)


def _tiny(seed=0, hidden=64):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=259, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=1024, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    return LlamaForCausalLM(cfg).float().eval()


def test_sft_loss_is_the_cross_entropy_of_the_target_tokens_only():
    from qatfactory.train.rl import warmup as W
    from qatfactory.train.data import ByteTokenizer
    tok, model = ByteTokenizer(), _tiny()
    task = R.make_task("arith", "tag", 0, n_train=1, n_eval=1)
    items = R.arith_warmup(3, [0, 3, 6], 1, ())
    ps, ts = W.prompt_ids(tok, task, items, True), W.target_ids(tok, task, items)
    assert len({len(t) for t in ts}) == 3 and all(t[-1] == tok.eos_token_id for t in ts)
    got = W.sft_loss(model, ps, ts, tok.pad_token_id, torch.device("cpu"))
    # one row at a time, no padding, every logit: sum of -log p(target token) over all targets
    nll, n = 0.0, 0
    with torch.no_grad():
        for p, t in zip(ps, ts):
            ids = torch.tensor([p + t])
            lsm = model(input_ids=ids).logits[0].double().log_softmax(-1)
            for k, tokid in enumerate(t):
                nll -= float(lsm[len(p) + k - 1, tokid])
                n += 1
    assert float(got) == pytest.approx(nll / n, rel=1e-5)



def test_sft_batches_are_right_padded_so_no_attention_row_is_fully_masked():
    """A left pad position attends to nothing; on the GPU (H100, 2026-12-06) the warm-up's loss turned NaN at
    step 21 of 24 with left padding. Right padding leaves every row a real token to attend to."""
    from qatfactory.train.rl import warmup as W
    ps, ts = [[1, 2, 3], [4], [5, 6]], [[7, 8], [9, 10, 11, 12], [13]]
    ids, attn, labels, K = W._batch(ps, ts, 0, torch.device("cpu"))
    assert attn[:, 0].all() and ids.tolist()[1] == [4, 9, 10, 11, 12] and ids.tolist()[2] == [5, 6, 13, 0, 0]
    assert K == 5 and labels.shape == (3, 5)
    # the logit at position j predicts token j + 1: labels hold exactly each row's targets, in order
    assert [[x for x in r if x != -100] for r in labels.tolist()] == ts
    assert labels.tolist()[0] == [-100, -100, 7, 8, -100]


def test_a_non_finite_step_is_skipped_and_too_many_stop_the_warm_up(monkeypatch):
    from qatfactory.train.rl import warmup as W
    from qatfactory.train.data import ByteTokenizer
    tok, model = ByteTokenizer(), _tiny()
    task = R.make_task("arith", "tag", 0, n_train=1, n_eval=1)
    items = R.arith_warmup(8, [0, 1], 1, ())
    real, calls = W.sft_loss, []

    def loss_with_nan_at(bad):
        def f(*a, **k):
            calls.append(1)
            out = real(*a, **k)
            return out * float("nan") if len(calls) - 1 in bad else out
        return f

    monkeypatch.setattr(W, "sft_loss", loss_with_nan_at({2}))
    info = W.sft_warmup(model, tok, task, items, 12, 1e-3, 2, True, 0)
    assert info["skipped_steps"] == [2] and len(info["grad_norms"]) == 12
    assert all(torch.isfinite(p).all() for p in model.parameters())
    calls.clear()
    monkeypatch.setattr(W, "sft_loss", loss_with_nan_at({1, 3}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient at steps \[1, 3\]"):
        W.sft_warmup(model, tok, task, items, 12, 1e-3, 2, True, 0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())   # steps 0 and 2 did run

def _format_rate(model, tok, task, items):
    from qatfactory.train.rl.rollout import SamplingConfig, generate
    from qatfactory.train.rl import warmup as W
    roll = generate(model, W.prompt_ids(tok, task, items, True), tok.eos_token_id, tok.pad_token_id,
                    SamplingConfig(60, 0.0, 1.0), tokenizer=tok)
    return sum(task.score(t, it)["format"] for t, it in zip(roll.texts, items)) / len(items), roll.texts


def test_a_tiny_warmup_makes_a_random_model_follow_the_answer_format():
    from qatfactory.train.rl import warmup as W
    from qatfactory.train.data import ByteTokenizer
    tok, model = ByteTokenizer(), _tiny()
    task = R.make_task("arith", "hash", 0, n_train=16, n_eval=16, seed=0)
    before, _ = _format_rate(model, tok, task, task.eval)
    # 150 steps at 3e-3: greedy decoding of a 64-wide model is all or nothing ('### N' for every prompt or
    # '#### N' for all), and 100 steps at 5e-3 landed on either side with the CPU's float order (passed on
    # another x86 CPU, 0.0 on an AVX2 EPYC). On the EPYC this setting gives 1.0 at model seeds 0-4;
    # 100 steps at 5e-3 gave 1.0 at one of three, and 200 at two of three (2026-12-07).
    items = R.arith_warmup(150 * 8, [0, 1], 0, R.arith_questions([0], 16, 16))
    info = W.sft_warmup(model, tok, task, items, 150, 3e-3, 8, True, 0)
    after, texts = _format_rate(model, tok, task, task.eval)
    assert before == 0.0
    assert after >= 0.75, texts[:3]
    assert info["loss_last"] < 0.5 * info["loss_first"], info
    assert next(model.parameters()).dtype == torch.float32 and not model.training


def test_calibration_fails_loudly_when_no_level_is_ever_right():
    with pytest.raises(R.NoSignal, match=r"no arithmetic level gave a single correct completion "
                                         r"\(pass rates \{0: 0.0\}\).*warmup_steps.*--warmup-steps"):
        R.pick_level(lambda k: 0.0, 0.2, 0.6)
    # plumbing checks may go on (the nearest level), and one correct answer anywhere is a signal
    assert R.pick_level(lambda k: 0.0, 0.2, 0.6, require_signal=False) == (0, {0: 0.0})
    assert R.pick_level(lambda k: {0: 0.9, 1: 0.01}[k], 0.2, 0.6, levels=[0, 1])[0] == 1
    # after a warm-up: the first level inside the band, walking from easy to hard
    rates = {0: 0.97, 1: 0.8, 2: 0.55, 3: 0.3}
    assert R.pick_level(lambda k: rates[k], 0.2, 0.6) == (2, {0: 0.97, 1: 0.8, 2: 0.55})


def test_save_model_dir_replaces_only_its_own_warmup_and_leaves_a_foreign_folder_alone(tmp_path):
    from qatfactory._fsutil import NotOursError
    from qatfactory.train.rl import warmup as W

    class Saves:                                     # the two calls save_model_dir makes on a model / tokenizer
        def __init__(self, text, name="model.safetensors"):
            self.text, self.name = text, name

        def save_pretrained(self, d):
            (Path(d) / self.name).write_text(self.text)

    out = tmp_path / "warmup"
    W.save_model_dir(Saves("one"), Saves("tok", "tokenizer.json"), None, out, {"steps": 1})
    W.save_model_dir(Saves("two"), Saves("tok", "tokenizer.json"), None, out, {"steps": 2})      # ours: replaced
    assert (out / "model.safetensors").read_text() == "two" and W.read_record(out)["steps"] == 2
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(NotOursError):
        W.save_model_dir(Saves("x"), Saves("tok", "tokenizer.json"), None, foreign, {"steps": 1})
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "warmup"]     # no temporaries left
