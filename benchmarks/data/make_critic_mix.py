"""Writes the vendored ``critic_mix`` set (src/conveyor/data/files/critic_mix/, issue 45): the 80
one-step sums of critic_easy_sums.jsonl (make_easy_sums.py) and 80 MAWPS multiarith rows (chosen
with random.Random(0), copied byte for byte from mawps/multiarith.jsonl). A main-job export solves
50-88% of the sums' samples and 0-25% of multiarith's at T = 0.6: the prompt's form predicts its
return, so a critic has something to learn (docs/results/critics.md). Deterministic.

Usage: python benchmarks/data/make_critic_mix.py
"""

import random
import shutil
from pathlib import Path

here = Path(__file__).resolve().parent
files = here.parents[1] / "src" / "conveyor" / "data" / "files"
out = files / "critic_mix"
out.mkdir(exist_ok=True)
shutil.copyfile(here / "critic_easy_sums.jsonl", out / "easy_sums.jsonl")
lines = [ln for ln in (files / "mawps" / "multiarith.jsonl").read_text().split("\n") if ln.strip()]
keep = sorted(random.Random(0).sample(range(len(lines)), 80))
(out / "multiarith.jsonl").write_text("".join(lines[i] + "\n" for i in keep))
print(f"wrote {out} (80 sums, 80 of {len(lines)} multiarith rows)")
