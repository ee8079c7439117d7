"""Rewards: exact numeric equality on real GSM8K lines (the packaged test split), the two answer
formats, the format reward, the generated arithmetic task and its calibration."""
import random
import re
from fractions import Fraction

import pytest

from qatfactory.train.rl import rewards as R


@pytest.fixture(scope="module")
def gsm8k():
    from qatfactory import assets
    return assets.gsm8k()


def test_every_gsm8k_gold_is_a_number_and_its_own_solution_scores(gsm8k):
    assert len(gsm8k) == 1319
    golds = [R.gsm8k_gold(r["answer"]) for r in gsm8k]
    assert all(R.parse_number(g) is not None for g in golds)
    assert golds[0] == "18"
    commas = [g for g in golds if "," in g]
    assert commas and R.parse_number("2,125") == 2125 and "2,125" in commas
    # each real solution text ends "#### N": the hash format scores it correct against its own gold
    assert all(R.correct(r["answer"], g, "hash") for r, g in zip(gsm8k, golds))
    # ... and against the next problem's gold only where the two numbers are equal
    shifted = sum(R.correct(r["answer"], g, "hash") for r, g in zip(gsm8k, golds[1:] + golds[:1]))
    equal = sum(R.parse_number(a) == R.parse_number(b) for a, b in zip(golds, golds[1:] + golds[:1]))
    assert shifted == equal < 40


def test_numeric_equality_not_first_character(gsm8k):
    # the released eval compares first characters only: 18 vs 19, 1 vs 18, 125 vs 1,250 would pass there
    assert R.numbers_equal("18", "18") and R.numbers_equal("18.00", "18") and R.numbers_equal("$18", "18")
    assert R.numbers_equal("2125", "2,125") and R.numbers_equal("18.", "18") and R.numbers_equal("-3", "-3.0")
    for a, b in (("19", "18"), ("1", "18"), ("125", "1,250"), ("18 eggs", "18"), ("", "18"), ("eighteen", "18"),
                 ("1,2345", "12345"), ("18/1", "18")):
        assert not R.numbers_equal(a, b), (a, b)
    assert R.parse_number("0.5") == Fraction(1, 2) and R.parse_number(".5") == Fraction(1, 2)
    assert R.parse_number("50%") == 50 and R.parse_number("-$5") == -5 and R.parse_number("$-5") == -5
    # real lines: a GSM8K solution whose final number is edited by one digit is wrong
    sol = gsm8k[0]["answer"]
    assert R.correct(sol, "18", "hash") and not R.correct(sol.replace("#### 18", "#### 19"), "18", "hash")


def test_answer_tag_and_format_reward():
    t = "<think>16 - 3 - 4 = 9, 9 * 2 = 18</think>\n<answer> 18 </answer>"
    assert R.extract_tag(t) == "18" and R.format_ok(t, "tag") and R.correct(t, "18", "tag")
    # the last <answer> block counts
    t2 = "<think>x</think><answer>5</answer> no wait <answer>18</answer>"
    assert R.extract_tag(t2) == "18"
    assert R.extract_tag("<answer>18") is None and not R.correct("<answer>18", "18", "tag")
    # correct without the think block: correctness yes, format no
    assert R.correct("<answer>18</answer>", "18", "tag") and not R.format_ok("<answer>18</answer>", "tag")
    assert R.extract_hash("so\n#### 42\n") == "42" and R.extract_hash("#### 1\n#### 2") == "2"
    assert R.extract_hash("no answer") is None and not R.format_ok("no answer", "hash")
    task = R.Task("gsm8k", [], [], "tag", 0.2, 2.0)
    item = R.Item("q", "18")
    assert task.score(t, item) == {"reward": 2.2, "correct": 1.0, "format": 1.0}
    assert task.score("<think>a</think><answer>17</answer>", item)["reward"] == pytest.approx(0.2)
    assert task.score("18", item)["reward"] == 0.0


def _solve(question: str) -> int:
    """An independent reading of the templates: the numbers and verbs in the sentences."""
    total = int(re.search(r"has (\d+) ", question).group(1))
    for s in question.split(". ")[1:]:
        m = re.search(r"gets (\d+) more", s) or re.search(r"gives away (\d+)", s) or \
            re.search(r"multiplied by (\d+)", s)
        if m is None:
            continue
        k = int(m.group(1))
        total = total + k if "gets" in s else total - k if "gives" in s else total * k
    return total


@pytest.mark.parametrize("level", range(len(R.ARITH_LEVELS)))
def test_arith_task_answers_are_right_and_seeded(level):
    t = R.make_task("arith", level=level, n_train=200, n_eval=20, seed=3)
    assert len(t.train) == 200 and len(t.eval) == 20
    for it in t.train + t.eval:
        assert int(it.gold) == _solve(it.question) >= 0, it
    again = R.make_task("arith", level=level, n_train=200, n_eval=20, seed=3)
    assert [i.question for i in again.train] == [i.question for i in t.train]
    assert {i.question for i in t.eval}.isdisjoint({i.question for i in t.train})


def test_pick_level_calibrates_to_the_band():
    rates = {0: 0.9, 1: 0.6, 2: 0.3, 3: 0.05}
    lv, seen = R.pick_level(lambda k: rates[k], 0.1, 0.5, levels=[0, 1, 2, 3])
    assert lv == 2 and seen == {0: 0.9, 1: 0.6, 2: 0.3}
    # nothing in the band: the nearest to its middle
    lv, _ = R.pick_level(lambda k: {0: 0.95, 1: 0.02}[k], 0.1, 0.5, levels=[0, 1])
    assert lv == 1


def test_say7_is_dense_and_unknown_task_fails_by_name():
    t = R.make_task("say7", n_train=5, n_eval=3)
    assert t.score("77x7", t.train[0], max_chars=8)["reward"] == 3 / 8              # 'x' is 65 code points away
    assert t.score("68", t.train[0], max_chars=4)["reward"] == pytest.approx((1 - 1 / 32 + 1 - 1 / 32) / 4)
    assert t.score("7", t.train[0])["correct"] == 1.0
    with pytest.raises(ValueError, match=r"task='gsm9k'; allowed"):
        R.make_task("gsm9k")
    with pytest.raises(ValueError, match="n_train=1200"):
        R.make_task("gsm8k", n_train=1200)
