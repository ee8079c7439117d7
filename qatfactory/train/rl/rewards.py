"""Rewards and prompt sets for RL: GSM8K, a generated arithmetic task, and "say 7".

Answer formats (``answer_format``):

* ``tag``: the QeRL prompt asks for ``<think>reasoning</think><answer>N</answer>``; the answer is the
  text between the last ``<answer>`` and the ``</answer>`` after it;
* ``hash``: the GSM8K solution style, a final line ``#### N``; the answer is the last such line.

Correctness is **numeric equality**: both sides are parsed as exact decimals (thousands separators,
a leading ``$``, a trailing ``.`` or ``%`` and surrounding spaces are tolerated; ``18``, ``18.0``,
``$18`` and ``18.00`` are all 18), never a string or first-character comparison (NVlabs/QeRL's
``eval/gsm8k.py`` scores a question right when only the first characters agree). An answer that is
not a number is wrong. The format reward is 1 when the completion has the shape its format asks for.

A task's reward for one completion is ``format_weight * format + correct_weight * correct`` (QeRL:
0.2 and 2.0); ``say7`` is shaped instead, for smoke tests of a random tiny model: each character
scores ``1 - |ord(c) - ord('7')| / 32`` (0 beyond), summed and divided by ``max_new_tokens``, so a
uniform random policy already sees a signal on a quarter of its bytes and the optimum is all '7'.

Tasks (``TASKS``): ``gsm8k`` (the packaged test split, qatfactory.assets: items 0..999 train, 1000..1318
held out), ``arith`` (templated word problems
with small integers, difficulty ``ARITH_LEVELS[level]``; :func:`pick_level` calibrates the level so
the base model's pass rate lands in a band, and raises :class:`NoSignal` when no level is ever answered
right), ``say7``.

Warm-up data (train/rl/warmup.py): every arith item carries its worked steps (``Item.solution``);
:func:`target_text` writes them in the exact shape the reward checks, and :func:`arith_warmup` draws solved
problems from streams of their own, never a question of :func:`arith_questions` (the RL pools and held-out
sets), so a supervised warm-up can teach the format without showing the model a prompt it is scored on.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from ... import assets

TASKS = ("say7", "arith", "gsm8k")
SAY7_WIDTH = 32      # say7: a character scores 1 - |code point - ord('7')| / 32, 0 beyond
ANSWER_FORMATS = ("tag", "hash")

SYSTEM_TAG = ("A conversation between User and Assistant. The user asks a question, and the assistant solves it. "
              "The assistant first thinks about the reasoning process and then gives the answer. The reasoning "
              "is enclosed in <think> </think> tags and the answer in <answer> </answer> tags, i.e. "
              "<think> reasoning here </think><answer> answer here </answer>. The answer is a single number.")
SYSTEM_HASH = ("Solve the math problem step by step. End with a final line of the form '#### N', "
               "where N is the answer as a single number.")

_NUM = re.compile(r"^[-+]?(\d{1,3}(,\d{3})+|\d+)?(\.\d+)?$")


def parse_number(text: Optional[str]) -> Optional[Fraction]:
    """The exact value of a number written as text, or None when it is not one number (a unit word
    such as "18 eggs" makes it not one)."""
    if text is None:
        return None
    s = text.strip()
    if s.endswith("%"):
        s = s[:-1].rstrip()
    if s.endswith("."):                 # a sentence's full stop: "18."
        s = s[:-1]
    neg = False
    for _ in range(2):                  # "-$5", "$-5", "$ 5"
        if s[:1] in ("-", "+"):
            neg, s = neg or s[0] == "-", s[1:].lstrip()
        if s[:1] == "$":
            s = s[1:].lstrip()
    if not _NUM.match(s) or not any(c.isdigit() for c in s):
        return None
    try:
        v = Fraction(Decimal(s.replace(",", "")))
    except (InvalidOperation, ValueError):
        return None
    return -v if neg else v


def numbers_equal(a: Optional[str], b: Optional[str]) -> bool:
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y


def gsm8k_gold(answer_field: str) -> str:
    """The gold answer of a GSM8K record: the text after its last '####'."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer has no '####' line: {answer_field[-80:]!r}")
    return answer_field.rsplit("####", 1)[1].strip()


_HASH = re.compile(r"####[ \t]*([^\n]*)")
_TAG_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)


def extract_hash(text: str) -> Optional[str]:
    """The answer on the last '#### ...' line (its first whitespace-separated word group), or None."""
    found = _HASH.findall(text)
    if not found:
        return None
    return found[-1].strip() or None


def extract_tag(text: str) -> Optional[str]:
    """The text between the last '<answer>' and the '</answer>' after it, stripped, or None."""
    i = text.rfind("<answer>")
    if i < 0:
        return None
    j = text.find("</answer>", i + len("<answer>"))
    if j < 0:
        return None
    return text[i + len("<answer>"):j].strip()


def extract(text: str, answer_format: str) -> Optional[str]:
    if answer_format == "tag":
        return extract_tag(text)
    if answer_format == "hash":
        return extract_hash(text)
    raise ValueError(f"answer_format={answer_format!r}; allowed: {list(ANSWER_FORMATS)}")


def format_ok(text: str, answer_format: str) -> bool:
    """Whether the completion has its format's shape: a think block then an answer block (tag), or a
    '#### ' line holding something (hash)."""
    if answer_format == "tag":
        return _TAG_FORMAT.search(text) is not None
    return extract_hash(text) is not None


def correct(text: str, gold: str, answer_format: str) -> bool:
    return numbers_equal(extract(text, answer_format), gold)


# ----------------------------------------------------------------------------- tasks
@dataclass
class Item:
    question: str
    gold: str
    solution: str = ""      # arith: the worked steps ("3 + 4 = 7. 7 * 2 = 14."), the warm-up's target


@dataclass
class Task:
    """Prompts (train/eval items) and the reward of a completion."""

    name: str
    train: List[Item]
    eval: List[Item]
    answer_format: str = "tag"
    format_weight: float = 0.2
    correct_weight: float = 2.0

    def system(self) -> Optional[str]:
        if self.name == "say7":
            return None
        return SYSTEM_TAG if self.answer_format == "tag" else SYSTEM_HASH

    def messages(self, item: Item) -> List[Dict[str, str]]:
        sys_p = self.system()
        return ([{"role": "system", "content": sys_p}] if sys_p else []) + [{"role": "user", "content": item.question}]

    def score(self, text: str, item: Item, max_chars: Optional[int] = None) -> Dict[str, float]:
        """{'reward', 'correct', 'format'} of one completion."""
        if self.name == "say7":
            n = max(1, max_chars or len(text))
            near = sum(max(0.0, 1.0 - abs(ord(c) - ord("7")) / SAY7_WIDTH) for c in text[:n])
            return {"reward": near / n, "correct": float(text.strip() == "7"), "format": 1.0}
        ok_f = format_ok(text, self.answer_format)
        ok_c = correct(text, item.gold, self.answer_format)
        return {"reward": self.format_weight * ok_f + self.correct_weight * ok_c,
                "correct": float(ok_c), "format": float(ok_f)}


# (steps, max operand, operations) per difficulty level
ARITH_LEVELS: Tuple[Tuple[int, int, str], ...] = (
    (1, 5, "+"), (1, 9, "+-"), (1, 20, "+-"), (2, 9, "+-"), (2, 20, "+-*"), (3, 20, "+-*"), (3, 50, "+-*"))

_NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")
_THINGS = ("apples", "marbles", "stamps", "shells", "coins", "books", "pencils", "cards")


def arith_item(rng: random.Random, level: int) -> Item:
    """One templated word problem with its exact integer answer (never negative) and its worked steps."""
    steps, hi, ops = ARITH_LEVELS[level]
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    total = rng.randint(1, hi)
    parts = [f"{name} has {total} {thing}."]
    work = []
    for _ in range(steps):
        op = rng.choice(ops)
        if op == "-" and total == 0:
            op = "+"
        before = total
        if op == "+":
            k = rng.randint(1, hi)
            parts.append(f"{name} gets {k} more {thing}.")
            total += k
        elif op == "-":
            k = rng.randint(1, total)
            parts.append(f"{name} gives away {k} {thing}.")
            total -= k
        else:
            k = rng.randint(2, 4)
            parts.append(f"Then the number of {thing} {name} has is multiplied by {k}.")
            total *= k
        work.append(f"{before} {op} {k} = {total}.")
    parts.append(f"How many {thing} does {name} have now?")
    return Item(" ".join(parts), str(total), " ".join(work))


def target_text(item: Item, answer_format: str) -> str:
    """The completion a supervised warm-up teaches for ``item``: its worked steps and its answer in the
    exact shape the reward checks (``<think> steps </think><answer>N</answer>``, or ``steps`` then a
    ``#### N`` line)."""
    if not item.solution:
        raise ValueError(f"target_text: item {item.question[:60]!r} has no worked solution (only arith items do)")
    if answer_format == "tag":
        return f"<think> {item.solution} </think><answer>{item.gold}</answer>"
    if answer_format == "hash":
        return f"{item.solution}\n#### {item.gold}"
    raise ValueError(f"answer_format={answer_format!r}; allowed: {list(ANSWER_FORMATS)}")


def arith_questions(seeds: Sequence[int], n_train: int, n_eval: int,
                    levels: Optional[Sequence[int]] = None) -> Set[str]:
    """Every question an RL run of task=arith with these seeds and pool sizes can prompt with or evaluate
    on (training pool and held-out set, at every level in ``levels``, default all): what a warm-up
    must never show the model."""
    out: Set[str] = set()
    for seed in seeds:
        for lv in (range(len(ARITH_LEVELS)) if levels is None else levels):
            t = make_task("arith", "tag", lv, n_train=n_train, n_eval=n_eval, seed=seed)
            out.update(i.question for i in t.train)
            out.update(i.question for i in t.eval)
    return out


def arith_warmup(n: int, levels: Optional[Sequence[int]] = None, seed: int = 0,
                 exclude: Iterable[str] = ()) -> List[Item]:
    """``n`` solved arith problems for a supervised warm-up, the levels taken in turn, drawn from the
    generator's own streams under a namespace no RL pool or held-out set uses ("arith-warmup-..."),
    never repeating a question and never one in ``exclude`` (pass :func:`arith_questions` of the RL
    runs: the low levels have only a few thousand distinct questions, so streams alone would collide)."""
    levels = list(range(len(ARITH_LEVELS))) if levels is None else list(levels)
    if not levels or any(not 0 <= lv < len(ARITH_LEVELS) for lv in levels):
        raise ValueError(f"warm-up levels {levels!r}; allowed: a non-empty list of 0..{len(ARITH_LEVELS) - 1}")
    excluded = set(exclude)
    seen = set(excluded)
    rngs = {lv: random.Random(f"arith-warmup-{seed}-{lv}") for lv in levels}
    out: List[Item] = []
    misses = 0                  # in a row: a level whose unused questions ran out never stops missing
    while len(out) < n:
        lv = levels[len(out) % len(levels)]
        it = arith_item(rngs[lv], lv)
        if it.question in seen:
            misses += 1
            if misses > 20_000:
                raise ValueError(f"arith warm-up: could not draw {n} problems at levels {levels} outside the "
                                 f"{len(excluded)} excluded questions (level {lv} has no unused question left); "
                                 f"lower the warm-up size or add harder levels")
            continue
        misses = 0
        seen.add(it.question)
        out.append(it)
    return out


def make_task(name: str, answer_format: str = "tag", level: int = 1, n_train: int = 1000, n_eval: int = 64,
              seed: int = 0, format_weight: float = 0.2, correct_weight: float = 2.0) -> Task:
    if name not in TASKS:
        raise ValueError(f"task={name!r}; allowed: {list(TASKS)}")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format={answer_format!r}; allowed: {list(ANSWER_FORMATS)}")
    if name == "say7":
        qs = ["Say 7.", "What number comes after 6?", "Reply with the digit seven.", "7?", "Write 7.",
              "Print seven as a digit.", "Which digit is seven?", "Type 7 and stop."]
        items = [Item(q, "7") for q in qs]
        rep = lambda k: [items[i % len(items)] for i in range(k)]  # noqa: E731
        return Task(name, rep(n_train), rep(n_eval), answer_format, format_weight, correct_weight)
    if name == "arith":
        if not 0 <= level < len(ARITH_LEVELS):
            raise ValueError(f"task_level={level!r}; allowed: 0..{len(ARITH_LEVELS) - 1} (rewards.ARITH_LEVELS)")
        # held-out items first (fixed by seed and level, whatever n_train), then training items
        # that never repeat a held-out question
        ev = [arith_item(random.Random(f"arith-eval-{seed}-{level}-{i}"), level) for i in range(n_eval)]
        held = {i.question for i in ev}
        rng = random.Random(f"arith-{seed}-{level}")
        train: List[Item] = []
        for _ in range(50 * n_train):
            if len(train) == n_train:
                break
            it = arith_item(rng, level)
            if it.question not in held:
                train.append(it)
        if len(train) < n_train:
            raise ValueError(f"task=arith level {level}: could not draw {n_train} training problems outside the "
                             f"{n_eval} held-out ones; lower n_train or n_eval")
        return Task(name, train, ev, answer_format, format_weight, correct_weight)
    recs = assets.gsm8k()
    items = [Item(r["question"], gsm8k_gold(r["answer"])) for r in recs]
    if n_train > 1000:
        raise ValueError(f"task=gsm8k: n_train={n_train}; allowed: <= 1000 (items 1000.. are held out)")
    return Task(name, items[:n_train], items[1000:1000 + n_eval], answer_format, format_weight, correct_weight)


class NoSignal(ValueError):
    """Calibration found no level where the model ever answers right: every GRPO/DAPO group would
    have zero advantage, so a run would spend its steps learning nothing."""


def pick_level(pass_rate: Callable[[int], float], lo: float = 0.1, hi: float = 0.5,
               levels: Optional[Sequence[int]] = None, require_signal: bool = True) -> Tuple[int, Dict[int, float]]:
    """Calibrate the arithmetic task: walk the levels from easy to hard, measuring the base model's
    pass rate with ``pass_rate(level)``; return the first level whose rate is in [lo, hi] (else the
    level nearest the band's middle) and every rate measured. When no measured level has a single
    correct completion (every rate 0) it raises :class:`NoSignal` (``require_signal=False``: returns
    the nearest level anyway, for plumbing checks)."""
    levels = list(range(len(ARITH_LEVELS))) if levels is None else list(levels)
    rates: Dict[int, float] = {}
    for lv in levels:
        rates[lv] = float(pass_rate(lv))
        if lo <= rates[lv] <= hi:
            return lv, rates
        if rates[lv] < lo:      # harder levels only get worse
            break
    if require_signal and not any(r > 0 for r in rates.values()):
        raise NoSignal(f"calibration: no arithmetic level gave a single correct completion (pass rates {rates}): "
                       f"every GRPO/DAPO group would have zero reward variance on the answer, so RL would learn "
                       f"nothing. Warm the model up on the answer format first (method.rl.warmup_steps, or "
                       f"benchmarks/papers/qerl.py --warmup-steps N), use a model that follows the format, or "
                       f"give the level explicitly")
    mid = (lo + hi) / 2
    return min(rates, key=lambda k: abs(rates[k] - mid)), rates
