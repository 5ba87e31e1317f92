"""Synthetic grade-school arithmetic word problems in GSM8K's format, and the BPE tokenizer trained on them
(``tools.tiny_tokenizer.train_bpe`` with every digit its own token).

Every problem is ``{"question": ..., "answer": "<steps>\\n#### N"}`` exactly like GSM8K, so that lm-eval's
``gsm8k`` prompt (``Question: ...\\nAnswer: ...``) and answer extraction (``#### N``) apply unchanged.
Numbers stay small (one-digit factors, sums below 200) so that a model of a few million parameters trained
for minutes on a CPU can learn to compute them; the templates cover shopping, sharing, rates and two-step
add/sub/mul/div problems.

Everything is a pure function of a seed: ``python -m vllm_dsv4_mtp.embedded.data --seed 0`` regenerates the
shipped files byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from vllm_dsv4_mtp.tools.tiny_tokenizer import save_tokenizer, train_bpe

# --------------------------------------------------------------------------------------------- vocabulary

NAMES = [
    ("Tom", "He"),
    ("Anna", "She"),
    ("Ben", "He"),
    ("Lily", "She"),
    ("Sam", "He"),
    ("Mia", "She"),
    ("Jack", "He"),
    ("Emma", "She"),
    ("Leo", "He"),
    ("Zoe", "She"),
    ("Max", "He"),
    ("Ella", "She"),
    ("Noah", "He"),
    ("Ruby", "She"),
    ("Finn", "He"),
    ("Kate", "She"),
    ("Omar", "He"),
    ("Nina", "She"),
    ("Paul", "He"),
    ("Rosa", "She"),
]
# (plural, price range in dollars) for things that are bought, counted and shared
ITEMS = [
    ("apples", (1, 4)),
    ("pencils", (1, 3)),
    ("books", (5, 9)),
    ("cookies", (1, 3)),
    ("marbles", (1, 2)),
    ("stickers", (1, 2)),
    ("toys", (4, 9)),
    ("cards", (1, 3)),
    ("eggs", (1, 2)),
    ("flowers", (2, 5)),
    ("shells", (1, 2)),
    ("candies", (1, 2)),
    ("balloons", (1, 3)),
    ("oranges", (1, 4)),
    ("cupcakes", (2, 5)),
]
VEHICLES = ["car", "bus", "train", "bike", "boat", "truck"]
CONTAINERS = ["boxes", "bags", "baskets", "jars"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]

Problem = dict[str, str]


def _person(rng: random.Random) -> tuple[str, str]:
    return rng.choice(NAMES)


def _two_people(rng: random.Random) -> tuple[tuple[str, str], tuple[str, str]]:
    a, b = rng.sample(NAMES, 2)
    return a, b


# ------------------------------------------------------------------------------------- written-out sums
# A sum or difference with a two- or three-digit operand is worked column by column first, ones first, as
# a child writes it: each column is one fact of a single-digit table (with the carry or borrow written as a
# third operand), and the result is read back from the columns. A model of a few million parameters learns
# single-digit tables and copying quickly; a two-digit sum written in one go needs the carry before the
# tens digit is written, which it learns slowly (the previous recipe's errors were almost all such digits).


def _digits(n: int, width: int) -> list[int]:
    """Digits of ``n``, ones first, padded with zeros to ``width``."""
    return [(n // 10**i) % 10 for i in range(width)]


def columns_add(a: int, b: int) -> str:
    """``34 + 19`` -> ``4 + 9 = 13, 3 + 1 + 1 = 5`` (the carry is the tens digit of the column before)."""
    width = max(len(str(a)), len(str(b)))
    parts, carry = [], 0
    for i, (x, y) in enumerate(zip(_digits(a, width), _digits(b, width))):
        s = x + y + carry
        parts.append(f"{x} + {y} = {s}" if i == 0 else f"{x} + {y} + {carry} = {s}")
        carry = s // 10
    return ", ".join(parts)


def columns_sub(a: int, b: int) -> str:
    """``34 - 6`` -> ``14 - 6 = 8, 3 - 0 - 1 = 2`` (a borrowed ten is written as the leading 1; the borrow is
    taken from the next column as its third operand). Needs ``a >= b``."""
    width = len(str(a))
    parts, borrow = [], 0
    for i, (x, y) in enumerate(zip(_digits(a, width), _digits(b, width))):
        d, top, nxt = x - y - borrow, f"{x}", 0
        if d < 0:
            d, top, nxt = d + 10, f"1{x}", 1
        parts.append(f"{top} - {y} = {d}" if i == 0 else f"{top} - {y} - {borrow} = {d}")
        borrow = nxt
    return ", ".join(parts)


def worked(a: int, op: str, b: int) -> str:
    """The written-out columns of ``a op b`` as a sentence (empty when both are single digits: a table fact)."""
    if a < 10 and b < 10:
        return ""
    cols = columns_add(a, b) if op == "+" else columns_sub(a, b)
    return f"{a} {op} {b}: {cols}."


def _answer(steps: list[str], result: int) -> str:
    return "\n".join(s for s in steps if s) + f"\n#### {result}"


# ---------------------------------------------------------------------------------------------- templates
# Each template draws its numbers, then writes the question and a short step-by-step solution. The
# arithmetic is always written "a op b = c" so the model sees every computation spelled out, after its
# worked columns where it has more than one digit (``worked``).


def t_add(rng: random.Random) -> Problem:
    (name, he), (items, _) = _person(rng), rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 30)
    c = a + b
    q = f"{name} has {a} {items}. {he} gets {b} more {items}. How many {items} does {name} have now?"
    return {"question": q, "answer": _answer([worked(a, "+", b), f"{name} has {a} + {b} = {c} {items} now."], c)}


def t_sub(rng: random.Random) -> Problem:
    ((name, he), (other, _)), (items, _) = _two_people(rng), rng.choice(ITEMS)
    a = rng.randint(10, 60)
    b = rng.randint(2, a - 1)
    c = a - b
    q = f"{name} had {a} {items}. {he} gave {b} {items} to {other}. How many {items} does {name} have left?"
    return {"question": q, "answer": _answer([worked(a, "-", b), f"{name} has {a} - {b} = {c} {items} left."], c)}


def t_shop(rng: random.Random) -> Problem:
    (name, _), (items, (lo, hi)) = _person(rng), rng.choice(ITEMS)
    n, price = rng.randint(2, 9), rng.randint(max(lo, 2), max(hi, 3))
    cost = n * price
    q = f"{name} buys {n} {items} for ${price} each. How much money does {name} spend?"
    return {"question": q, "answer": _answer([f"{name} spends {n} * {price} = ${cost}."], cost)}


def t_shop_change(rng: random.Random) -> Problem:
    (name, he), (items, (lo, hi)) = _person(rng), rng.choice(ITEMS)
    n, price = rng.randint(2, 9), rng.randint(max(lo, 2), max(hi, 3))
    cost = n * price
    money = cost + rng.randint(1, 40)
    left = money - cost
    q = f"{name} has ${money}. {he} buys {n} {items} for ${price} each. How much money does {name} have left?"
    steps = [
        f"The {items} cost {n} * {price} = ${cost}.",
        worked(money, "-", cost),
        f"{name} has {money} - {cost} = ${left} left.",
    ]
    return {"question": q, "answer": _answer(steps, left)}


def t_shop_two(rng: random.Random) -> Problem:
    (name, _he), (items, (lo, hi)) = _person(rng), rng.choice(ITEMS)
    n, price = rng.randint(2, 9), rng.randint(max(lo, 2), max(hi, 3))
    extra = rng.randint(2, 20)
    cost = n * price
    total = cost + extra
    q = f"{name} buys {n} {items} for ${price} each and a bag for ${extra}. How much money does {name} spend in total?"
    steps = [
        f"The {items} cost {n} * {price} = ${cost}.",
        worked(cost, "+", extra),
        f"In total {name} spends {cost} + {extra} = ${total}.",
    ]
    return {"question": q, "answer": _answer(steps, total)}


def t_share(rng: random.Random) -> Problem:
    (name, _), (items, _) = _person(rng), rng.choice(ITEMS)
    k, each = rng.randint(2, 9), rng.randint(2, 9)
    total = k * each
    q = f"{name} has {total} {items} and shares them equally among {k} friends. How many {items} does each friend get?"
    return {"question": q, "answer": _answer([f"Each friend gets {total} / {k} = {each} {items}."], each)}


def t_share_two(rng: random.Random) -> Problem:
    (name, he), (items, _) = _person(rng), rng.choice(ITEMS)
    k, each = rng.randint(2, 9), rng.randint(2, 9)
    total = k * each
    eat = rng.randint(1, 9)
    start = total + eat
    q = (
        f"{name} has {start} {items}. {he} keeps {eat} and shares the rest equally among {k} friends. "
        f"How many {items} does each friend get?"
    )
    steps = [
        worked(start, "-", eat),
        f"{name} shares {start} - {eat} = {total} {items}.",
        f"Each friend gets {total} / {k} = {each} {items}.",
    ]
    return {"question": q, "answer": _answer(steps, each)}


def t_rate(rng: random.Random) -> Problem:
    vehicle = rng.choice(VEHICLES)
    speed, hours = rng.randint(2, 9), rng.randint(2, 9)
    dist = speed * hours
    q = f"A {vehicle} travels {speed} miles every hour. How many miles does it travel in {hours} hours?"
    return {"question": q, "answer": _answer([f"It travels {speed} * {hours} = {dist} miles."], dist)}


def t_wage(rng: random.Random) -> Problem:
    (name, he) = _person(rng)
    wage = rng.randint(2, 9)
    d1, d2 = rng.sample(DAYS, 2)
    h1, h2 = rng.randint(1, 5), rng.randint(1, 4)
    hours = h1 + h2
    pay = hours * wage
    q = (
        f"{name} earns ${wage} an hour. {he} works {h1} hours on {d1} and {h2} hours on {d2}. "
        f"How much money does {name} earn?"
    )
    steps = [f"{name} works {h1} + {h2} = {hours} hours.", f"{name} earns {hours} * {wage} = ${pay}."]
    return {"question": q, "answer": _answer(steps, pay)}


def t_boxes(rng: random.Random) -> Problem:
    (name, he), (items, _) = _person(rng), rng.choice(ITEMS)
    box = rng.choice(CONTAINERS)
    n, per = rng.randint(2, 9), rng.randint(2, 9)
    loose = rng.randint(1, 20)
    inside = n * per
    total = inside + loose
    q = (
        f"{name} has {n} {box} with {per} {items} in each. {he} also has {loose} more {items}. "
        f"How many {items} does {name} have in total?"
    )
    steps = [
        f"The {box} hold {n} * {per} = {inside} {items}.",
        worked(inside, "+", loose),
        f"{name} has {inside} + {loose} = {total} {items}.",
    ]
    return {"question": q, "answer": _answer(steps, total)}


def t_add_sub(rng: random.Random) -> Problem:
    (name, he), (items, _) = _person(rng), rng.choice(ITEMS)
    a, b = rng.randint(5, 40), rng.randint(2, 30)
    mid = a + b
    c = rng.randint(1, mid - 1)
    end = mid - c
    q = f"{name} had {a} {items}. {he} found {b} more and then lost {c}. How many {items} does {name} have now?"
    steps = [
        worked(a, "+", b),
        f"After finding {items} {name} has {a} + {b} = {mid}.",
        worked(mid, "-", c),
        f"Then {name} has {mid} - {c} = {end} {items}.",
    ]
    return {"question": q, "answer": _answer(steps, end)}


TEMPLATES: list[Callable[[random.Random], Problem]] = [
    t_add,
    t_sub,
    t_shop,
    t_shop_change,
    t_shop_two,
    t_share,
    t_share_two,
    t_rate,
    t_wage,
    t_boxes,
    t_add_sub,
]


def problems(seed: int) -> Iterator[Problem]:
    """An endless, seeded stream of problems (templates chosen uniformly)."""
    rng = random.Random(seed)
    while True:
        yield rng.choice(TEMPLATES)(rng)


def make_splits(seed: int = 0, n_train: int = 20000, n_test: int = 1000) -> tuple[list[Problem], list[Problem]]:
    """Train and held-out splits. Held-out questions are unique and never appear in train.

    The held-out stream uses seed ``2*seed+1`` and train ``2*seed``; train skips any question that is in
    held-out (and its own duplicates), so the splits are disjoint by question text.
    """
    test: list[Problem] = []
    seen: set[str] = set()
    for p in problems(2 * seed + 1):
        if p["question"] not in seen:
            seen.add(p["question"])
            test.append(p)
        if len(test) == n_test:
            break
    train: list[Problem] = []
    for p in problems(2 * seed):
        if p["question"] not in seen:
            seen.add(p["question"])
            train.append(p)
        if len(train) == n_train:
            break
    return train, test


def answer_number(answer: str) -> str | None:
    """The ``#### N`` value of a GSM8K-style answer (None when absent)."""
    marker = answer.rfind("####")
    if marker < 0:
        return None
    tail = answer[marker + 4 :].strip().split()
    return tail[0].replace(",", "").rstrip(".") if tail else None


# ---------------------------------------------------------------------------------------------- text format
# lm-eval's gsm8k task: doc_to_text "Question: {q}\nAnswer:", target " {answer}", fewshot delimiter "\n\n".


def format_example(p: Problem) -> str:
    return f"Question: {p['question']}\nAnswer: {p['answer']}"


def format_prompt(question: str, fewshot: list[Problem] = ()) -> str:
    """Few-shot prompt in lm-eval's gsm8k layout (the model was trained on exactly this layout)."""
    shots = "".join(format_example(p) + "\n\n" for p in fewshot)
    return shots + f"Question: {question}\nAnswer:"


def write_jsonl(path: Path, rows: list[Problem]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: Path) -> list[Problem]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def build_assets(
    out_dir: Path,
    seed: int = 0,
    n_train: int = 20000,
    n_test: int = 1000,
    n_fewshot: int = 16,
    vocab_size: int = 1024,
    write_train: bool = False,
) -> tuple[list[Problem], list[Problem]]:
    """Write the held-out set, the few-shot examples and the tokenizer (and optionally the train split)."""
    train, test = make_splits(seed, n_train, n_test)
    write_jsonl(out_dir / "gsm_tiny_test.jsonl", test)
    write_jsonl(out_dir / "gsm_tiny_fewshot.jsonl", train[:n_fewshot])
    if write_train:
        write_jsonl(out_dir / "gsm_tiny_train.jsonl", train)
    tok = train_bpe([format_example(p) for p in train], vocab_size, split_digits=True)
    save_tokenizer(tok, out_dir / "tokenizer")
    return train, test


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=20000)
    ap.add_argument("--n-test", type=int, default=1000)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "assets")
    ap.add_argument("--write-train", action="store_true", help="also write gsm_tiny_train.jsonl")
    args = ap.parse_args(argv)
    train, test = build_assets(
        args.out, args.seed, args.n_train, args.n_test, vocab_size=args.vocab_size, write_train=args.write_train
    )
    print(f"train {len(train)} / held-out {len(test)} problems -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
