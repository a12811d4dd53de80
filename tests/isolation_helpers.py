"""Helpers of ``test_reward_isolation.py`` that reward worker processes import by name (a test
module's functions would drag pytest into every worker), and the freeze scenario that test runs in
a child process (a regression would freeze the whole interpreter, so it must not run inside
pytest's).

Run the scenario by hand: ``PYTHONPATH=tests .venv/bin/python -c
"import isolation_helpers as h; h.main()" 1.5``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from conveyor.rewards import correctness_reward
from conveyor.types import Sample

PATHOLOGICAL = r"Answer: \boxed{9^{9^{9^{9}}}}"
"""The model output of issue 10, section 3: math-verify computes 9^(9^(9^9)) (a ~370-million-digit
integer) holding the GIL; in a thread it froze engine, controller and trainer for 150 s."""

GIL_HOG = "HOG Answer: 1"
"""A response on which :func:`checker` holds the GIL for minutes whatever the answer checker
does (so the scenario keeps testing isolation if math-verify ever gets fast on PATHOLOGICAL)."""

MAIN_PID_ENV = "CONVEYOR_TEST_MAIN_PID"


def checker(response: str, sample: Sample) -> float:
    """:func:`conveyor.rewards.correctness_reward`, except that a response starting with
    ``"HOG"`` first computes ``9 ** 9 ** 9`` (a ~370-million-digit integer: minutes of C code that
    never releases the GIL)."""
    if response.startswith("HOG"):
        pow(9, 9**9)
    return correctness_reward(response, sample)


def outside_main_process(response: str, sample: Sample) -> float:
    """1.0 when called in a process other than the one whose pid is in ``$CONVEYOR_TEST_MAIN_PID``
    (i.e. in a reward worker), else 0.0: a "checker" whose answer tells where it ran."""
    return 0.0 if str(os.getpid()) == os.environ.get(MAIN_PID_ENV) else 1.0


def sleeps_then_correct(response: str, sample: Sample) -> float:
    """1.0 after 0.3 s (a slow answer check)."""
    import time

    time.sleep(0.3)
    return 1.0


def raises(response: str, sample: Sample) -> float:
    """A metric function that always fails."""
    raise RuntimeError("metric boom")


def freeze_scenario(timeout_s: float) -> dict:
    """The engine and a trainer work while the rollout workflow checks a pathological answer.

    A real :class:`~conveyor.rollout.engine.InferenceEngine` (tiny model) keeps decoding
    background requests; the workflow runs one episode of two responses (the engine generates
    them, their text is replaced by :data:`PATHOLOGICAL` and :data:`GIL_HOG`) in an asyncio loop
    thread, as the rollout controller does; meanwhile the calling thread runs trainer steps on a
    fixed batch. The reward service (:func:`checker`, process backend, ``timeout_s``) must kill
    both checks.

    Returns:
        ``episode_s`` (s, the episode's wall time), ``reward_s`` (s, its scoring part),
        ``trainer_steps_during_check`` / ``decode_steps_during_check`` (progress made while the
        checks ran), ``correct``, ``format_ok``, ``reward_failed`` (per response),
        ``metric_failures`` (the service's count).
    """
    import asyncio
    import copy
    import threading
    import time
    from dataclasses import replace

    import torch

    from conveyor.config import LossConfig, TrainerConfig
    from conveyor.models import load_model
    from conveyor.rewards import RewardService
    from conveyor.rollout.engine import InferenceEngine, SamplingParams
    from conveyor.rollout.workflow import SingleTurnMathWorkflow
    from conveyor.trainer.trainer import Trainer
    from conveyor.types import Trajectory

    torch.set_num_threads(1)
    lm = load_model("tiny", seed=0)
    svc = RewardService(
        checker,
        metrics={"correct": checker, "format_ok": "format"},
        timeout_s=timeout_s,
        max_workers=2,
    )
    engine = InferenceEngine(
        copy.deepcopy(lm.model).eval(), lm.tokenizer, max_batch_size=8, num_threads=1
    )
    engine.start()
    trainer = Trainer(lm.model, TrainerConfig(lr=1e-4, warmup_steps=0, bf16=False), LossConfig())
    g = torch.Generator().manual_seed(0)
    batch = []
    for i in range(2):  # one small GRPO group: a short trainer step
        p = torch.randint(3, 1000, (4,), generator=g).tolist()
        r = torch.randint(3, 1000, (4,), generator=g).tolist()
        batch.append(
            Trajectory(
                sample=Sample("s0", "q", "1", "t"),
                group_id="g0",
                prompt_ids=p,
                response_ids=r,
                behaviour_logprobs=[-7.0] * 4,
                versions=[0] * 4,
                reward=float(i),
            )
        )
    trainer.train_step(batch)  # warm-up (first-step allocations)
    if not svc.wait_ready(300):
        raise RuntimeError("reward workers did not start")
    print("READY", flush=True)  # set-up done: from here a frozen process is a failure

    texts = iter([PATHOLOGICAL, GIL_HOG])

    class ScriptedEngine:
        """The real engine generates; the response text is replaced by the scripted one."""

        async def generate(self, prompt_ids, params):
            out = await engine.generate(prompt_ids, params)
            return replace(out, text=next(texts))

    workflow = SingleTurnMathWorkflow(
        lm.tokenizer,
        svc,
        SamplingParams(max_new_tokens=4, temperature=1.0),
        group_size=2,
        tool="none",
    )
    sample = Sample("q/1", "What is 0 + 1?", "1", "t")
    done: dict = {}

    def episode() -> None:
        t0 = time.monotonic()
        done["trajs"] = asyncio.run(workflow.run_episode(ScriptedEngine(), sample))
        done["t_end"] = time.monotonic()
        done["episode_s"] = done["t_end"] - t0

    background = SamplingParams(max_new_tokens=64, temperature=1.0)
    pending = [engine.submit([1, 2, 3, 4], background) for _ in range(4)]
    log: list[tuple[float, int, int]] = []  # (time, trainer steps, engine decode steps)
    steps = 0
    th = threading.Thread(target=episode, daemon=True)
    th.start()
    while th.is_alive():
        pending = [f for f in pending if not f.done()]
        pending += [engine.submit([1, 2, 3, 4], background) for _ in range(4 - len(pending))]
        trainer.train_step(batch)
        steps += 1
        log.append((time.monotonic(), steps, engine.stats()["decode_steps"]))
    th.join()
    engine.stop()
    stats = svc.stats
    logging.getLogger("conveyor.rewards.service").disabled = True  # restarts cut short by the exit
    svc.close(wait=False)
    trajs = done["trajs"]
    reward_s = trajs[0].metadata["reward_seconds"]
    start, end = done["t_end"] - reward_s, done["t_end"]
    first = ([x for x in log if x[0] <= start] or [(start, 0, 0)])[-1]
    last = ([x for x in log if x[0] <= end] or [first])[-1]
    return {
        "episode_s": done["episode_s"],
        "reward_s": reward_s,
        # finished strictly while the checks ran: [start, end]
        "trainer_steps_during_check": last[1] - first[1],
        "decode_steps_during_check": last[2] - first[2],
        "correct": [t.correct for t in trajs],
        "format_ok": [t.metadata["format_ok"] for t in trajs],
        "reward_failed": [t.metadata["reward_failed"] for t in trajs],
        "metric_failures": stats["metric_failures"],
    }


def main() -> None:
    """Run :func:`freeze_scenario` with ``timeout_s`` = argv[1] and print its result as JSON."""
    print("RESULT " + json.dumps(freeze_scenario(float(sys.argv[1]))), flush=True)
