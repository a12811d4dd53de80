"""Cold vs cached load time of the default model (issue: later loads must take < 3 s).

Usage: python benchmarks/model_load.py [--model smollm2-135m-instruct] [--quick]

Cold: a fresh, empty cache directory (dequantizes the GGUF file). Warm: the same directory again.
Each load runs in a fresh process so that import caches do not flatter the warm figure. Prints
one JSON line with both times (seconds) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import time, json, sys
t0 = time.perf_counter()
from conveyor.models import load_model
t1 = time.perf_counter()
lm = load_model(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "from_cache": lm.from_cache}))
"""


def one(model: str, cache: str) -> dict:
    env = dict(os.environ, CONVEYOR_CACHE=cache)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["process_s"] = time.perf_counter() - t0
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quick", action="store_true", help="use the tiny preset (CI smoke run)")
    a = ap.parse_args()
    model = "tiny" if a.quick else a.model
    with tempfile.TemporaryDirectory() as cache:
        cold = one(model, cache)
        warm = one(model, cache)
    print(json.dumps({"model": model, "cold": cold, "warm": warm, "warm_over_cold": warm["load_s"] / cold["load_s"]}))


if __name__ == "__main__":
    main()
