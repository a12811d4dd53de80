"""Writes critic_easy_sums.jsonl next to this file: 80 one-step sums in words (2-6 things plus 2-4
more), the easy half of benchmarks/critic_learning.py's task (issue 45): a main-job export
solves 50-88% of their samples at T = 0.6, against 0-25% of MAWPS multiarith's two-step problems,
so the prompt's form says most of what its return will be. Deterministic (seed 0).

Usage: python benchmarks/data/make_easy_sums.py
"""

import json
import random
from pathlib import Path

rng = random.Random(0)
names = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Jack", "Emma", "Leo", "Zoe", "Max", "Ava"]
things = ["apples", "pencils", "books", "marbles", "stickers", "cookies", "cards", "balloons", "shells", "coins"]
rows = []
for _ in range(80):
    n, t = rng.choice(names), rng.choice(things)
    a, b = rng.randint(2, 6), rng.randint(2, 4)
    rows.append({"question": f"{n} has {a} {t}. {n} gets {b} more {t}. How many {t} does {n} have now?",
                 "answer": str(a + b)})
out = Path(__file__).with_name("critic_easy_sums.jsonl")
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"wrote {out} ({len(rows)} problems)")
