"""The behaviour checks a user of a chat model needs beside held-out KL: does the quantized model answer at the
teacher's length, and does it keep the answer format a prompt asks for. A fixed prompt set, answered greedily:

* ``PROMPTS``: each asks for a format that a rule can check (one word, yes/no, a numbered list of three, JSON with
  one key, ...); ``LONG``: open questions whose answers run long (length only: the QAD report's Nemotron run came
  out 18% shorter on long reasoning).
* ``adheres(rule, text)``: whether an answer keeps its prompt's format;
* ``summary(answers, teacher)``: mean answer length (tokens) and its ratio to the teacher's, the fraction of format
  prompts kept, and how many greedy answers equal the teacher's word for word.

Standard library only.
"""
from __future__ import annotations

import json
import re
import statistics
from typing import Any, Dict, List, Sequence, Tuple

PROMPTS: List[Tuple[str, str]] = [
    ("one_word", "What is the capital of France? Answer with one word only."),
    ("yes_no", "Is the sun a star? Answer with yes or no only."),
    ("numbered_3", "List three fruits as a numbered list (1., 2., 3.), one per line, with nothing else."),
    ("json_answer", 'Reply only with a JSON object with the single key "answer": what is 2 + 3?'),
    ("upper_hello", "Write the word hello in capital letters and nothing else."),
    ("number_only", "How many days are in a week? Answer with a number only."),
    ("three_lines", "Write a short poem about the sea in exactly three lines."),
    ("starts_sure", "Start your answer with 'Sure:' and then name one planet."),
    ("max_ten_words", "In at most ten words, what is photosynthesis?"),
    ("comma_pair", "Name two primary colors, separated by a comma, and nothing else."),
    ("count_1_5", "Count from 1 to 5, separated by spaces, and nothing else."),
    ("one_sentence", "Define gravity in one sentence."),
]
LONG: List[Tuple[str, str]] = [
    ("long_bicycle", "Explain step by step how a bicycle turns the rider's pedalling into motion."),
    ("long_water", "Describe the water cycle in detail."),
    ("long_story", "Write a short story about a robot that learns to paint."),
    ("long_math", "A shop sells pens at 3 dollars each and notebooks at 5 dollars each. Tom buys 4 pens and 2 "
                  "notebooks. How much does he pay? Think step by step."),
]


def _words(s: str) -> List[str]:
    return re.findall(r"[A-Za-z0-9']+", s)


def _json_obj(s: str):
    s = s.strip()
    m = re.search(r"```(?:json)?\s*(.*?)```", s, re.S)
    if m:
        s = m.group(1).strip()
    try:
        return json.loads(s)
    except ValueError:
        return None


def adheres(rule: str, text: str) -> bool:
    t = text.strip()
    lines = [ln.strip() for ln in t.splitlines() if ln.strip()]
    if rule == "one_word":
        return len(_words(t)) == 1
    if rule == "yes_no":
        return re.fullmatch(r"(?i)(yes|no)[.!]?", t) is not None
    if rule == "numbered_3":
        return len(lines) == 3 and all(re.match(rf"{i + 1}[.)]\s*\S", ln) for i, ln in enumerate(lines))
    if rule == "json_answer":
        o = _json_obj(t)
        return isinstance(o, dict) and list(o) == ["answer"]
    if rule == "upper_hello":
        return t.strip(" .!\"'") == "HELLO"
    if rule == "number_only":
        return re.fullmatch(r"\d+\.?", t) is not None
    if rule == "three_lines":
        return len(lines) == 3
    if rule == "starts_sure":
        return t.startswith("Sure:") and len(_words(t)) > 1
    if rule == "max_ten_words":
        return 0 < len(_words(t)) <= 10
    if rule == "comma_pair":
        parts = [p.strip(" .") for p in t.split(",")]
        return len(parts) == 2 and all(0 < len(_words(p)) <= 2 for p in parts)
    if rule == "count_1_5":
        return re.fullmatch(r"1 2 3 4 5\.?", t) is not None
    if rule == "one_sentence":
        return len(re.findall(r"[.!?](?:\s|$)", t)) == 1 and t[-1] in ".!?"
    raise ValueError(f"behaviour rule {rule!r}; allowed: {', '.join(r for r, _ in PROMPTS)}")


def all_prompts() -> List[Tuple[str, str]]:
    return PROMPTS + LONG


def summary(answers: Sequence[Dict[str, Any]], teacher: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """``answers`` / ``teacher``: one {"text", "tokens"} per prompt of all_prompts(), in order."""
    prompts = all_prompts()
    if len(answers) != len(prompts) or len(teacher) != len(prompts):
        raise ValueError(f"{len(answers)} / {len(teacher)} answers for {len(prompts)} prompts")
    rules = [r for r, _ in PROMPTS]
    kept = [adheres(r, a["text"]) for r, a in zip(rules, answers)]
    t_kept = [adheres(r, a["text"]) for r, a in zip(rules, teacher)]
    n_long = len(LONG)
    mean = statistics.fmean(a["tokens"] for a in answers)
    t_mean = statistics.fmean(a["tokens"] for a in teacher)
    long_mean = statistics.fmean(a["tokens"] for a in answers[-n_long:])
    t_long = statistics.fmean(a["tokens"] for a in teacher[-n_long:])
    return {"mean_tokens": mean, "length_ratio": mean / t_mean if t_mean else None,
            "long_mean_tokens": long_mean, "long_length_ratio": long_mean / t_long if t_long else None,
            "format_kept": sum(kept) / len(kept), "format_kept_teacher": sum(t_kept) / len(t_kept),
            "format_same_as_teacher": sum(a == b for a, b in zip(kept, t_kept)) / len(kept),
            "same_answer": sum(a["text"].strip() == b["text"].strip() for a, b in zip(answers, teacher)) / len(prompts),
            "truncated": sum(a.get("finish") == "length" for a in answers),
            "kept_by_rule": dict(zip(rules, kept))}
