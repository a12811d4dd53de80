"""Evaluation: pass@1, pass@k, avg@k, format rate, response length and generation speed.

``conveyor eval`` and the trainer's before/after held-out evaluation both call :func:`evaluate`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conveyor.prompts import build_prompt_ids
from conveyor.rewards import correctness_reward, format_ok
from conveyor.types import Sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator of Chen et al. 2021 (arXiv 2107.03374, eq. 1 and its numerically
    stable form in Figure 3): ``1 - C(n - c, k) / C(n, k)``.

    Args:
        n: Samples drawn for the problem (n >= 1).
        c: How many of them are correct (0 <= c <= n).
        k: The k of pass@k (1 <= k <= n).

    Returns:
        The probability that at least one of k samples drawn without replacement from the n is
        correct, in [0, 1].

    Raises:
        ValueError: if the arguments violate the constraints above.
    """
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@dataclass
class EvalResult:
    """Aggregate evaluation figures (see :func:`evaluate`).

    Attributes:
        dataset: Dataset spec. model: model reference. num_problems, samples_per_problem: counts.
        pass_at_1: Mean over problems of c / n (unbiased pass@1).
        pass_at_k: Mean over problems of :func:`pass_at_k` (n, c, k) for each reported k.
        avg_at_k: Mean accuracy over all n samples of all problems (equals pass@1 when every
            problem has the same n; reported under its common name).
        format_rate: Share of responses in the strict answer format (``rewards.format_ok``).
        mean_response_tokens: Mean generated tokens per response (tokens).
        tokens_per_second: Generated tokens / generation wall-clock (tokens/s).
        wall_seconds: Generation wall-clock (s).
        temperature, max_new_tokens: Sampling settings.
        records: Per-problem details (question id, answer, responses, verdicts).
    """

    dataset: str
    model: str
    num_problems: int
    samples_per_problem: int
    pass_at_1: float
    pass_at_k: dict[str, float]
    avg_at_k: float
    format_rate: float
    mean_response_tokens: float
    tokens_per_second: float
    wall_seconds: float
    temperature: float
    max_new_tokens: int
    records: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """All figures except the per-problem records."""
        d = asdict(self)
        d.pop("records")
        return d

    def write_json(self, path: str | Path, include_records: bool = True) -> None:
        """Write the result as JSON (creating parent directories)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        d = asdict(self) if include_records else self.summary()
        p.write_text(json.dumps(d, indent=2))


def _ks(n: int, k: int) -> list[int]:
    ks = {1, k}
    p = 2
    while p < k:
        ks.add(p)
        p *= 2
    return sorted(x for x in ks if x <= n)


def evaluate(
    engine,
    tokenizer,
    samples: list[Sample],
    *,
    k: int = 1,
    samples_per_problem: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 128,
    instruction: str = "",
    dataset: str = "",
    model_name: str = "",
    progress: bool = True,
    tool: str = "none",
    max_tool_calls: int = 4,
) -> EvalResult:
    """Generate ``samples_per_problem`` responses for every sample and score them.

    All requests are submitted at once and the engine batches them continuously; greedy decoding
    when ``temperature == 0`` (then one sample per problem is enough and extra ones are identical).

    Args:
        engine: A started :class:`conveyor.rollout.engine.InferenceEngine`.
        tokenizer: The model's tokenizer (chat template used for prompts).
        samples: Problems to evaluate.
        k: The k of pass@k (pass@1, powers of two up to k and k itself are reported).
        samples_per_problem: n >= k responses per problem (default k).
        temperature, top_p, max_new_tokens: Sampling settings (max_new_tokens in tokens).
        instruction: Appended to every question (answer-format instruction).
        progress: Show a rich progress bar.
        tool: ``"calculator"`` evaluates the tool-using agent (:mod:`conveyor.rollout.tools`);
            response lengths then count actions and observations.
        max_tool_calls: Observations per response at most.

    Returns:
        An :class:`EvalResult`.

    Raises:
        ValueError: empty ``samples`` or ``samples_per_problem < k``.
    """
    from conveyor.rollout.engine import SamplingParams

    n = samples_per_problem or k
    if not samples:
        raise ValueError("evaluate: no samples to evaluate (empty dataset or --n 0)")
    if tool not in ("none", "calculator"):
        raise ValueError(f"evaluate: tool must be 'none' or 'calculator', got {tool!r}")
    if n < k or k < 1:
        raise ValueError(f"evaluate: need 1 <= k <= samples_per_problem, got k={k}, samples_per_problem={n}")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    prompts = [build_prompt_ids(tokenizer, s, instruction) for s in samples]
    total = len(samples) * n

    async def run_all(bar=None, task=None):
        async def one(i: int):
            if tool == "calculator":
                from conveyor.rollout.tools import generate_with_calculator

                out = await generate_with_calculator(engine, tokenizer, prompts[i], params, max_calls=max_tool_calls)
            else:
                out = await engine.generate(prompts[i], params)
            if bar is not None:
                bar.advance(task)
            return i, out

        return await asyncio.gather(*[one(i) for i in range(len(samples)) for _ in range(n)])

    t0 = time.perf_counter()
    if progress:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        with Progress(
            TextColumn("eval {task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn(), transient=False,
        ) as bar:
            task = bar.add_task(dataset or "", total=total)
            outs = asyncio.run(run_all(bar, task))
    else:
        outs = asyncio.run(run_all())
    wall = time.perf_counter() - t0

    by_problem: dict[int, list] = {}
    for i, out in outs:
        by_problem.setdefault(i, []).append(out)
    records = []
    p1, pk = [], {str(kk): [] for kk in _ks(n, k)}
    n_fmt = n_tok = n_correct_all = 0
    for i, s in enumerate(samples):
        resps = by_problem[i]
        verdicts = [correctness_reward(o.text, s) >= 1.0 for o in resps]
        fmts = [format_ok(o.text) for o in resps]
        c = sum(verdicts)
        n_correct_all += c
        n_fmt += sum(fmts)
        n_tok += sum(len(o.token_ids) for o in resps)
        p1.append(c / n)
        for kk in pk:
            pk[kk].append(pass_at_k(n, c, int(kk)))
        records.append({
            "id": s.id, "answer": s.answer, "correct": verdicts, "format_ok": fmts,
            "responses": [o.text for o in resps],
        })
    gen_tokens = n_tok
    return EvalResult(
        dataset=dataset,
        model=model_name,
        num_problems=len(samples),
        samples_per_problem=n,
        pass_at_1=sum(p1) / len(p1),
        pass_at_k={kk: sum(v) / len(v) for kk, v in pk.items()},
        avg_at_k=n_correct_all / total,
        format_rate=n_fmt / total,
        mean_response_tokens=gen_tokens / total,
        tokens_per_second=gen_tokens / wall if wall > 0 else math.nan,
        wall_seconds=wall,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        records=records,
    )
