"""Evaluation: pass@1, pass@k, avg@k, format rate, response length and generation speed.

``conveyor eval`` and the trainer's before/after held-out evaluation both call :func:`evaluate`.
Answers are checked in the reward service's worker processes, with a timeout
(:data:`~conveyor.rewards.ANSWER_METRICS`), never in this process: a pathological answer costs
one worker its timeout and is counted as ``correct_unknown`` (issue 10, section 3).

A training run's export (``RUN/export``) carries the settings its held-out evaluation used in
``conveyor.json`` (:data:`EXPORT_SETTINGS_FILE`, written by :func:`write_export_settings`):
``conveyor eval --model RUN/export`` evaluates with them by default, so it reproduces the run's
figure (issue 10, section 5b: a run trained with the calculator tool scored 0.0 when evaluated
without it). ``--model RUN`` (the run directory itself, :func:`resolve_eval_model`) evaluates
``RUN/export`` the same way; a run without an export is refused, saying why it has none.

Graders (issue 44, section 1). By default correctness is the built-in answer checker
(:func:`conveyor.rewards.math.correctness_reward`). With a reward function (``conveyor eval
--reward module:fn``; a run's held-out evaluation when its ``reward.fn`` is not a built-in) every
response is scored by that function: ``reward_mean`` is the mean reward and a response *passes*
when its reward is at least ``pass_threshold`` (default 1.0), or, when the function has its own
``correct`` metric (an attribute ``fn.correct``, a function of ``(response, sample)``), when that
metric is at least 1. ``pass_definition`` says which rule counted and ``graders`` names the grader
of each figure. A run's export carries its ``reward`` section, so ``conveyor eval RUN`` grades with
the run's reward by default.

Every evaluation records the policy version it measured (``policy_version``: a run's held-out
evaluations the version the runtime evaluated, ``conveyor eval`` of an export the
``policy_version`` of its ``conveyor.json``; None for other models and for files written before
the field existed, which still load: readers use ``.get``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.faults import fault_point
from conveyor.prompts import build_prompt_ids
from conveyor.rewards import ANSWER_METRICS, RewardService
from conveyor.types import Sample

if TYPE_CHECKING:
    from conveyor.config import TrainConfig

log = logging.getLogger(__name__)

EXPORT_SETTINGS_FILE = "conveyor.json"
"""Name of the settings file next to an export's Hugging Face files."""

EXPORT_SETTINGS_FORMAT = 1
"""Version of :data:`EXPORT_SETTINGS_FILE`'s layout (keys are only ever added)."""


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
        wall_seconds: Generation wall-clock (s); an environment's episodes include their reward
            checks.
        check_seconds: Wall-clock of the answer checks after generation (s; single responses:
            :meth:`~conveyor.rewards.RewardService.check_many`; 0 for an environment). The
            evaluation's own time is ``wall_seconds + check_seconds``.
        temperature, max_new_tokens: Sampling settings.
        top_p: Nucleus sampling setting.
        tool: ``"none"`` or ``"calculator"`` (the agent evaluated). max_tool_calls: its limit.
        instruction: The instruction appended to every question.
        correct_unknown: Responses whose answer check failed (timed out or crashed in the
            reward service): correctness unknown, counted as wrong in every figure above. An
            episode cut by a limit before the environment's verdict is not unknown but wrong
            (:class:`~conveyor.rollout.agent.AgentWorkflow`; counted in ``episodes_cut``).
        settings_from: The export settings file the defaults came from (``conveyor eval
            --model RUN/export``), or None.
        split_seed: The data set's split seed (set by ``conveyor eval``), or None.
        policy_version: The policy version evaluated (optimizer steps): set by a run's held-out
            evaluations (:func:`conveyor.runtime.inline.heldout_eval`) and by ``conveyor eval``
            of a run's export (its ``conveyor.json``); None otherwise (any other model, or an
            evaluation file written before the field existed).
        init: ``pretrained`` (the model's weights) or ``random`` (its architecture with random
            weights, ``conveyor eval --init random``: a speed measurement, not the model's
            accuracy; ``policy_version`` is then None).
        env: The environment whose episodes were evaluated (``env.name``), ``"none"`` for
            single responses. The figures below are set only with an environment (None
            otherwise, and left out of :meth:`summary`):
        max_turns, max_episode_tokens: The episode limits.
        tool_format: The tool-call format the episodes used (``env.tool_format``).
        env_options: The environment's keyword options (``env.options``, ``--env-option``).
        turns_mean: Model turns per episode, mean (this, ``tool_calls_mean``, ``reward_mean``
            and ``mean_response_tokens`` over the episodes that did not fail).
        tool_calls_mean: Turns that called a tool, per episode, mean.
        tool_call_rate: Share of model turns that called a tool.
        tool_call_success_rate: Share of tool calls that ran and succeeded (None without calls).
        sandbox_incidents: Sandbox incidents of all episodes by kind
            (:data:`conveyor.envs.sandbox.INCIDENT_KINDS`; empty for environments without a
            sandboxed tool).
        reward_mean: The episodes' summed rewards, mean.
        episodes_cut: Episodes ended by a limit (turns, tokens) rather than by the environment;
            wrong unless the environment had already reported ``correct``.
        episodes_failed: Episodes whose agent or environment raised (all ``n`` of a problem's
            episodes, as they run as one group), counted as wrong in every figure (their record
            has ``error``; the first traceback is in the log). Every problem failing raises
            :class:`~conveyor.rollout.controller.EpisodesFailedError` instead: there is no
            figure to report.
        metrics_mean: The reward service's further metrics (beyond ``correct`` / ``format_ok``),
            each a mean over the responses where it was computed, e.g. the preference-shift
            task's ``style_<name>`` (share judged in each style: :data:`conveyor.rewards.styles.
            STYLE_METRICS`); empty when the service computes none.
        reward_fn: The reward function that scored every response (``--reward``, a run's
            ``reward.fn``), or None (the built-in answer checker only).
        pass_threshold: With ``reward_fn`` and no ``correct`` metric of its own: a response
            passes when its reward is >= this; None otherwise.
        pass_definition: What made a response count as correct in ``pass_at_1``, ``pass_at_k``
            and ``avg_at_k`` (e.g. ``"reward >= 1.0 (myrewards:score)"``).
        graders: For each figure (``pass_at_1``, ``pass_at_k``, ``avg_at_k``, ``format_rate``,
            ``reward_mean``) the function or rule that produced it (None: not computed).
        reward_failures: With ``reward_fn``: responses whose reward call failed (raised, timed
            out, not a number): left out of ``reward_mean``, counted as not passing (and in
            ``correct_unknown``); None without ``reward_fn``.
        records: Per-problem details (question id, answer, responses, verdicts: True, False or
            None when unknown; with ``reward_fn`` each response's reward, None when it failed; with an environment also each episode's turns, reward and
            counters, and ``episode_ids``: the first episode's exact token ids, ``prompt`` (P),
            ``response`` (R, observations included) and ``action_mask`` (R, 1 = generated)).
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
    top_p: float = 1.0
    tool: str = "none"
    max_tool_calls: int = 4
    instruction: str = ""
    correct_unknown: int = 0
    check_seconds: float = 0.0
    settings_from: str | None = None
    split_seed: int | None = None
    policy_version: int | None = None
    init: str = "pretrained"
    env: str = "none"
    max_turns: int | None = None
    max_episode_tokens: int | None = None
    tool_format: str | None = None
    env_options: dict[str, Any] | None = None
    turns_mean: float | None = None
    tool_calls_mean: float | None = None
    tool_call_rate: float | None = None
    tool_call_success_rate: float | None = None
    sandbox_incidents: dict[str, int] | None = None
    reward_mean: float | None = None
    episodes_cut: int | None = None
    episodes_failed: int | None = None
    metrics_mean: dict[str, float] = field(default_factory=dict)
    reward_fn: str | None = None
    pass_threshold: float | None = None
    pass_definition: str | None = None
    graders: dict[str, str | None] = field(default_factory=dict)
    reward_failures: int | None = None
    records: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """All figures except the per-problem records (and, for single responses, without the
        environment's figures)."""
        d = asdict(self)
        d.pop("records")
        if self.env == "none":
            for key in _AGENT_FIELDS:
                if not (key == "reward_mean" and self.reward_fn is not None):  # --reward: the mean reward
                    d.pop(key)
        return d

    def write_json(self, path: str | Path, include_records: bool = True) -> None:
        """Write the result as JSON (creating parent directories; atomically: a failed write
        leaves no half-written file).

        Raises:
            RunFileError: the file cannot be written (naming it and the OS's reason).
        """
        from conveyor.runtime_files import atomic_write_text, describe_os_error

        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise describe_os_error(e, str(p)) from e
        d = asdict(self) if include_records else self.summary()
        atomic_write_text(p, json.dumps(d, indent=2), what=str(p))


_AGENT_FIELDS = ("env", "max_turns", "max_episode_tokens", "tool_format", "env_options", "turns_mean", "tool_calls_mean", "tool_call_rate",
                 "tool_call_success_rate", "sandbox_incidents", "reward_mean", "episodes_cut", "episodes_failed")


def write_export_settings(export_dir: str | Path, cfg: TrainConfig, *, policy_version: int,
                          heldout_pass_at_1: float | None = None, interrupted: bool = False) -> Path:
    """Write :data:`EXPORT_SETTINGS_FILE` (``conveyor.json``) into a run's export directory: what
    evaluating the exported policy needs to reproduce the run's own held-out figure.

    Keys: ``format`` (:data:`EXPORT_SETTINGS_FORMAT`), ``base_model``, ``policy_version``,
    ``export_dtype`` (``run.export_dtype``; with ``"bfloat16"`` every weight is rounded, so an
    evaluation of the export can differ slightly from the run's own, made with the fp32 policy),
    ``instruction``, ``tool``, ``max_tool_calls``, ``data`` (``train``, ``heldout``,
    ``heldout_limit``, ``split_seed``), ``training_sampling`` (the rollout's ``temperature``,
    ``top_p``, ``top_k``, ``min_p``, ``max_new_tokens``: how the policy was sampled while it was
    trained), ``eval`` (the held-out evaluation's settings: ``dataset``, ``limit``,
    ``split_seed``, ``k``, ``temperature`` (0, greedy), ``top_p``, ``max_new_tokens``) and
    ``heldout_pass_at_1`` (the run's figure with those settings, None when not evaluated),
    ``total_steps`` (``trainer.total_steps``) and ``interrupted`` (true: the run stopped before
    ``total_steps``, by a Ctrl-C / SIGTERM or a monitor's ``stop`` action; the export is the
    policy at ``policy_version``, not the final one), and
    ``env`` (the ``env`` config section, when ``env.name`` is not ``none``: ``conveyor eval`` then
    runs that environment's episodes), and ``style`` (the preference-shift task,
    ``data.style_schedule`` set: ``schedule``, ``every`` and the ``target`` in force at
    ``policy_version``; ``conveyor eval`` then judges each response's style, pass@1 being the
    share in the target, as the run's own held-out evaluation), and ``reward`` (``fn``:
    ``reward.fn``, ``pass_threshold``: ``reward.pass_threshold``, and ``heldout_grader``: the
    reward function the held-out evaluation graded with, :func:`run_grader_kwargs`, or None for
    the built-in checker; ``conveyor eval`` of the export grades with it by default).

    Args:
        export_dir: The export directory (must exist).
        cfg: The run's :class:`~conveyor.config.TrainConfig`.
        policy_version: The exported policy's version (optimizer steps).
        heldout_pass_at_1: The run's held-out pass@1 after training, if measured.
        interrupted: The run was stopped before ``trainer.total_steps``.

    Returns:
        The path of the written file.

    Raises:
        conveyor.runtime_files.RunFileError: the file cannot be written (e.g. a full disk; an
            ``OSError``); no partial file is left.
    """
    d, ro = cfg.data, cfg.rollout
    settings = {
        "format": EXPORT_SETTINGS_FORMAT,
        "base_model": cfg.model.name,
        "policy_version": policy_version,
        "export_dtype": getattr(cfg.run, "export_dtype", "float32"),
        "instruction": d.instruction,
        "tool": ro.tool,
        "max_tool_calls": ro.max_tool_calls,
        "data": {"train": d.train, "heldout": d.heldout, "heldout_limit": d.heldout_limit,
                 "split_seed": d.split_seed},
        "training_sampling": {"temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k,
                              "min_p": getattr(ro, "min_p", 0.0),
                              "max_new_tokens": ro.max_new_tokens},
        # the run's held-out evaluation (runtime.inline.heldout_eval): run.eval_samples responses
        # per problem at run.eval_temperature (1 at 0: greedy); pass@1 is their mean
        "eval": {"dataset": d.heldout or None, "limit": d.heldout_limit, "split_seed": d.split_seed,
                 "k": 1, "samples": getattr(cfg.run, "eval_samples", 1),
                 "temperature": getattr(cfg.run, "eval_temperature", 0.0), "top_p": 1.0,
                 "max_new_tokens": cfg.run.eval_max_new_tokens},
        "heldout_pass_at_1": heldout_pass_at_1,
        "total_steps": cfg.trainer.total_steps,
        "interrupted": bool(interrupted),
        # the grader of the held-out figure: conveyor eval RUN grades with the run's own reward (issue 44)
        "reward": {"fn": cfg.reward.fn, "pass_threshold": cfg.reward.pass_threshold,
                   "heldout_grader": run_grader_kwargs(cfg).get("reward_fn")},
    }
    env = getattr(cfg, "env", None)
    if env is not None and env.name != "none":
        settings["env"] = env.model_dump(mode="json")
    if d.style_schedule:  # the preference-shift task: conveyor eval judges the target in force at this version
        from conveyor.rollout.style_schedule import style_at_version

        settings["style"] = {"schedule": list(d.style_schedule), "every": d.style_every,
                             "target": style_at_version(d.style_schedule, d.style_every, max(0, policy_version))}
    from conveyor.runtime_files import atomic_write_json

    return atomic_write_json(Path(export_dir) / EXPORT_SETTINGS_FILE, settings,
                             what="the export settings")


def unknown_note(res: EvalResult) -> str:
    """A console note on ``res``'s answers whose check failed (``correct_unknown``: timed out or
    crashed in the reward service, counted as wrong) and episodes that failed
    (``episodes_failed``: the agent or environment raised, counted as wrong), or ``""`` when
    there are none (fresh-user findings: a held-out figure of 0.000 hid that every check had
    timed out; one raising agent episode aborted the whole evaluation)."""
    total = res.num_problems * res.samples_per_problem
    note = ""
    if res.correct_unknown:
        note += (f"  [yellow]{res.correct_unknown} of {total} answers unknown[/] (their checks failed, see "
                 "train.log; counted as wrong)")
    if res.episodes_failed:
        note += (f"  [yellow]{res.episodes_failed} of {total} episodes failed[/] (the agent or environment "
                 "raised, see train.log; counted as wrong)")
    return note


BUILTIN_CHECKER = ("conveyor.rewards.math:correctness_reward (the built-in answer checker; reasoning-gym tasks: "
                   "the task's own scorer)")
"""The grader of correctness without a reward function (:data:`~conveyor.rewards.ANSWER_METRICS`)."""

FORMAT_GRADER = "conveyor.rewards.math:format_reward (a final 'Answer:' line, a \\boxed{} or <answer></answer>)"
"""The grader of ``format_rate`` for single responses."""

STYLE_CHECKER = "conveyor.rewards.styles:style_reward (judged in the target style)"
"""The grader of correctness on the preference-shift task (:data:`conveyor.rewards.styles.STYLE_METRICS`)."""


def correct_metric_path(reward_fn: str) -> str | None:
    """The import path of a reward function's own ``correct`` metric: its attribute ``correct``
    (``fn.correct = is_right``, a function of ``(response, sample)``, 1.0 = correct), as a path
    the reward workers load (``"myrewards:score"`` -> ``"myrewards:score.correct"``); None when the
    function has no callable ``correct``.

    Raises:
        ValueError: ``reward_fn`` cannot be loaded (:func:`conveyor.rewards.load_reward_fn`).
    """
    from conveyor.rewards import BUILTIN_REWARD_FNS, load_reward_fn

    fn = load_reward_fn(reward_fn)
    if not callable(getattr(fn, "correct", None)):
        return None
    path = reward_fn.strip()
    if path in BUILTIN_REWARD_FNS:
        return None
    if ":" not in path:
        module, _, attr = path.rpartition(".")
        path = f"{module}:{attr}"
    return f"{path}.correct"


@dataclass(frozen=True)
class RewardGrader:
    """How an evaluation grades with a reward function (:func:`reward_grader`).

    Attributes:
        reward_fn: The reward function (a built-in name or an import path).
        threshold: A response passes when its reward is >= this (without ``correct_metric``).
        correct_metric: The path of the function's own ``correct`` metric, or None.
    """

    reward_fn: str
    threshold: float
    correct_metric: str | None

    @property
    def pass_definition(self) -> str:
        """The rule, in words (:attr:`EvalResult.pass_definition`)."""
        if self.correct_metric is not None:
            return f"{self.correct_metric} >= 1.0 (the reward function's own correct metric)"
        return f"reward >= {self.threshold:g} ({self.reward_fn})"

    def metrics(self) -> dict[str, str]:
        """The reward service's metrics: ``format_ok`` and, with its own metric, ``correct``."""
        out = {"format_ok": "format"}
        if self.correct_metric is not None:
            out["correct"] = self.correct_metric
        return out

    def graders(self) -> dict[str, str | None]:
        """:attr:`EvalResult.graders` for single responses graded by this reward."""
        rule = self.pass_definition
        return {"pass_at_1": rule, "pass_at_k": rule, "avg_at_k": rule, "format_rate": FORMAT_GRADER,
                "reward_mean": self.reward_fn}


def reward_grader(reward_fn: str, pass_threshold: float = 1.0) -> RewardGrader:
    """The :class:`RewardGrader` of a reward function: pass = its own ``correct`` metric when it
    has one (:func:`correct_metric_path`), else reward >= ``pass_threshold``.

    Raises:
        ValueError: ``reward_fn`` cannot be loaded, or ``pass_threshold`` is not finite.
    """
    if isinstance(pass_threshold, bool) or not isinstance(pass_threshold, int | float) or not math.isfinite(
            pass_threshold):
        raise ValueError(f"pass threshold must be a finite number, got {pass_threshold!r}")
    return RewardGrader(reward_fn.strip(), float(pass_threshold), correct_metric_path(reward_fn))


def run_grader_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """The :func:`evaluate` keyword arguments that make a run's held-out evaluation grade with the
    run's own reward: ``reward_fn`` (``reward.fn``), ``pass_threshold`` (``reward.pass_threshold``)
    and ``check_timeout_s`` (``reward.timeout_s``) when ``reward.fn`` is the user's (not a built-in
    name of :data:`~conveyor.rewards.BUILTIN_REWARD_FNS`) and the run has no environment (an
    environment's episodes report their own verdict and reward); else ``{}`` (the built-in
    checker, as before)."""
    from conveyor.rewards import BUILTIN_REWARD_FNS

    fn = cfg.reward.fn.strip()
    if fn in BUILTIN_REWARD_FNS or getattr(getattr(cfg, "env", None), "name", "none") != "none":
        return {}
    return {"reward_fn": fn, "pass_threshold": cfg.reward.pass_threshold, "check_timeout_s": cfg.reward.timeout_s}


def reward_note(res: EvalResult) -> str:
    """A console note with the mean reward and the pass rule of an evaluation graded by a reward
    function (``""`` without one)."""
    if res.reward_fn is None:
        return ""
    mean = "n/a" if res.reward_mean is None else f"{res.reward_mean:.3f}"
    failed = f", {res.reward_failures} rewards failed" if res.reward_failures else ""
    return f"  mean reward {mean} (pass: {res.pass_definition}{failed})"


def load_export_settings(model: str | Path) -> dict[str, Any] | None:
    """The :data:`EXPORT_SETTINGS_FILE` of a model directory (a run's export), or None when the
    model is not a directory or has no such file (a preset, a .gguf file, any other HF model).

    Args:
        model: The ``--model`` reference.

    Returns:
        The settings (see :func:`write_export_settings`), or None.

    Raises:
        ValueError: the file exists but is not a JSON object, or a key has the wrong type
            (the message names the file and the key).
    """
    path = Path(model) / EXPORT_SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        settings = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from e
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(settings).__name__}")
    expected = {"instruction": str, "tool": str, "max_tool_calls": int, "eval": dict, "env": dict,
                "policy_version": int, "reward": dict}
    for key, typ in expected.items():
        if key in settings and not isinstance(settings[key], typ):
            got = repr(settings[key])[:80]
            raise ValueError(f"{path}: key {key!r} must be a {typ.__name__}, got {got}")
    return settings


def export_policy_version(export: str | Path) -> int | None:
    """The ``policy_version`` an export's :data:`EXPORT_SETTINGS_FILE` records; None when there
    is no such file, it is unreadable (:func:`load_export_settings` refuses it) or it has none."""
    try:
        return (load_export_settings(export) or {}).get("policy_version")
    except ValueError:
        return None


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` is a ``conveyor train`` run directory rather than a model: a directory
    whose ``config.json`` is a conveyor config (``model``, ``rollout`` and ``trainer`` sections,
    no Hugging Face ``model_type``). A Hugging Face model directory (``config.json`` with
    ``model_type``), a run's ``export/``, a file or a preset name are not."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (isinstance(data, dict) and "model_type" not in data
            and all(isinstance(data.get(key), dict) for key in ("model", "rollout", "trainer")))


def _no_export_reason(run_dir: Path) -> str:
    """Why a run directory has no ``export/``, as far as its files tell."""
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
        export = (cfg.get("run") or {}).get("export", True)
    except (OSError, ValueError, AttributeError):
        export = True
    if export is False:
        return "the run was started with run.export=false"
    if not (run_dir / "summary.json").is_file():
        return (f"the run has not finished: it was interrupted, crashed or is still running "
                f"(`conveyor train --resume {run_dir}` finishes it and writes the export)")
    return "the run finished without one, or it was deleted"


def resolve_eval_model(model: str, *, verb: str = "evaluating") -> tuple[str, str | None]:
    """The model ``conveyor eval --model MODEL`` (and ``conveyor serve --model MODEL``) loads.

    A ``conveyor train`` run directory (:func:`is_run_dir`) is not a model: its ``config.json``
    is the run's config. Given one, its export ``RUN/export`` is evaluated (the run's final
    policy, with the settings of its ``conveyor.json``, exactly as ``--model RUN/export``; the
    first choice of ``conveyor inspect RUN`` too). Unlike ``conveyor inspect``, there is no
    fallback to a checkpoint or the base model: a run without an export is refused.

    Args:
        model: The ``--model`` reference.
        verb: What the note says is done with the export (``serving`` for ``conveyor serve``).

    Returns:
        ``(model to load, note)``: ``model`` itself and None for anything but a run directory;
        ``RUN/export`` and a note saying so for a run directory.

    Raises:
        ValueError: a run directory without a usable export (one line naming ``RUN/export`` and
            why it is missing: ``run.export=false``, the run not finished, or an export without
            its ``config.json``), or a run being trained now (its ``run.lock`` held: any export
            is from before; fresh-user trial 4, finding 5).
    """
    run_dir = Path(model)
    if not is_run_dir(run_dir):
        return model, None
    export = run_dir / "export"
    from conveyor.runtime_files import holder_name, lock_holder

    holder = lock_holder(run_dir)
    if holder is not None:  # a run being trained (a resume): its export, if any, is from before
        old = ""
        if (export / "config.json").is_file():
            v = export_policy_version(export)
            old = (f"; its export {export} holds policy version {v} from before" if v is not None else
                   f"; its export {export} is from before")
        raise ValueError(f"--model {model}: the run is being trained now by {holder_name(holder)} (it holds "
                         f"{run_dir / 'run.lock'})"
                         f"{old}; wait for it to finish, or name the export itself (--model {export}) to use "
                         "that older policy knowingly")
    if (export / "config.json").is_file():
        settings = load_export_settings(export) or {}
        if settings.get("interrupted"):
            what = (f"the policy at version {settings.get('policy_version')} of {settings.get('total_steps')}: the "
                    f"run was stopped early, this is not its final policy; `conveyor train --resume {model}` "
                    "finishes it and exports again")
        else:
            what = "the run's final policy"
        return str(export), f"{model} is a conveyor training run directory: {verb} its export {export} ({what})"
    if export.is_dir():
        why = f"{export} has no config.json: an incomplete export (the run stopped while exporting?)"
    else:
        why = f"{export} does not exist: {_no_export_reason(run_dir)}"
    raise ValueError(f"--model {model} is a conveyor training run directory, not a model, and it has no usable "
                     f"export ({why}); --model takes a model: a run's export (RUN/export), a preset, a Hugging Face "
                     "directory or a .gguf file")


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
    reward_service: RewardService | None = None,
    check_timeout_s: float = 10.0,
    env: Any = None,
    reward_fn: str | None = None,
    pass_threshold: float = 1.0,
) -> EvalResult:
    """Generate ``samples_per_problem`` responses for every sample and score them; with ``env``,
    run that many episodes of the environment per sample instead.

    All requests are submitted at once and the engine batches them continuously; greedy decoding
    when ``temperature == 0`` (then one sample per problem is enough and extra ones are identical).
    Answers are checked in reward-service worker processes (see the module docstring).

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
        reward_service: The service that checks the answers (:meth:`RewardService.check_many`:
            its metrics only, not its reward function, so a training run's service serves); it
            must compute :data:`~conveyor.rewards.ANSWER_METRICS`. Default: a private one (one
            worker process), closed on return.
        check_timeout_s: Seconds one answer check may take in the private service (> 0).
        env: An environment's settings (:class:`conveyor.config.EnvConfig`, ``name`` not
            ``none``): every response is an episode of
            :class:`~conveyor.rollout.agent.AgentWorkflow` (each turn at most
            ``max_new_tokens`` tokens, ``env.max_turns`` turns, ``env.max_episode_tokens``
            response tokens); correctness and format are what the environment reports
            (``math_python``: the final answer graded in ``reward_service``); the agent figures
            of :class:`EvalResult` are filled in. None (or ``name == "none"``): single responses.
        reward_fn: Grade with this reward function (a built-in name or ``module:fn``; module
            docstring): every response is scored in a private reward service (one worker,
            ``check_timeout_s``; ``reward_service`` is not used), ``reward_mean`` is reported and
            a response passes when its reward is >= ``pass_threshold``, or by the function's own
            ``correct`` metric. None: the built-in answer checker. Not with an environment.
        pass_threshold: The reward a response needs to pass (with ``reward_fn``).

    Returns:
        An :class:`EvalResult`.

    Raises:
        ValueError: empty ``samples``, ``samples_per_problem < k``, an unknown ``tool``, a
            ``tool`` other than ``"none"`` with an environment, an environment that cannot be
            built, a ``reward_service`` without the answer metrics, a ``reward_fn`` that cannot
            be loaded, with an environment, or a non-finite ``pass_threshold``.
    """
    from conveyor.rollout.engine import SamplingParams

    n = samples_per_problem or k
    if not samples:
        raise ValueError("evaluate: no samples to evaluate (empty dataset or --n 0)")
    if tool not in ("none", "calculator"):
        raise ValueError(f"evaluate: tool must be 'none' or 'calculator', got {tool!r}")
    if n < k or k < 1:
        raise ValueError(f"evaluate: need 1 <= k <= samples_per_problem, got k={k}, samples_per_problem={n}")
    if env is not None and getattr(env, "name", "none") != "none" and reward_fn is not None:
        raise ValueError(f"evaluate: reward_fn={reward_fn!r} with an environment (env.name={env.name}): the "
                         "environment's episodes report their own verdict and reward")
    grader = reward_grader(reward_fn, pass_threshold) if reward_fn is not None else None
    if grader is not None:
        reward_service = None  # a private service: the reward and the grader's own metrics
    if reward_service is not None:
        missing = [m for m in ANSWER_METRICS if m not in reward_service.metric_names]
        if missing:
            raise ValueError(f"evaluate: reward_service does not compute the metrics {missing} "
                             "(RewardService(..., metrics=conveyor.rewards.ANSWER_METRICS))")
    if env is not None and getattr(env, "name", "none") == "none":
        env = None
    if env is not None and tool != "none":
        raise ValueError(f"evaluate: tool={tool!r} is the single-turn calculator; with an environment "
                         f"(env.name={env.name}) the environment brings its own tools: use tool='none'")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    prompts = [] if env is not None else [build_prompt_ids(tokenizer, s, instruction) for s in samples]
    total = len(samples) * n
    # started before generation: its worker process loads while the engine generates
    private = reward_service is None
    if env is not None and private:
        from conveyor.envs.registry import needs_reward_service

        private = needs_reward_service(env)  # guess rewards by itself: no worker to start
    if grader is not None:
        service = RewardService(grader.reward_fn, metrics=grader.metrics(), timeout_s=check_timeout_s, max_workers=1)
    else:
        service = reward_service if not private else RewardService("correctness", metrics=ANSWER_METRICS,
                                                                    timeout_s=check_timeout_s, max_workers=1)
    try:
        if env is not None:
            return _run_episodes(engine, tokenizer, samples, params, service, env, n=n, k=k, dataset=dataset,
                                 model_name=model_name, progress=progress, instruction=instruction)
        return _generate_and_score(engine, tokenizer, samples, prompts, params, service, n=n, k=k,
                                   total=total, dataset=dataset, model_name=model_name,
                                   progress=progress, tool=tool, max_tool_calls=max_tool_calls,
                                   instruction=instruction, grader=grader)
    finally:
        if private:
            service.close()


def _graded(service, pairs, grader: RewardGrader | None) -> list[dict[str, float | None]]:
    """One dict of metric values per ``(response, sample)`` pair: the service's metrics only
    (:meth:`~conveyor.rewards.RewardService.check_many`) without a grader; with one, the reward
    too (``"reward"``, None when the call failed) and ``correct`` by the grader's pass rule."""
    if grader is None:
        return service.check_many(pairs)
    out = []
    for r in service.score_many(pairs):
        m: dict[str, float | None] = dict(r.metrics)
        reward = None if r.failed else float(r.score)
        if grader.correct_metric is None:
            m["correct"] = None if reward is None else float(reward >= grader.threshold)
        m["reward"] = reward
        out.append(m)
    return out


def _generate_and_score(engine, tokenizer, samples, prompts, params, service, *, n, k, total,
                        dataset, model_name, progress, tool, max_tool_calls,
                        instruction, grader: RewardGrader | None = None) -> EvalResult:
    """The body of :func:`evaluate` (generation, then the isolated answer checks; with a
    ``grader``, the reward function's scores)."""

    async def run_all(bar=None, task=None):
        async def one(i: int):
            if tool == "calculator":
                from conveyor.rollout.tools import generate_with_calculator

                out = await generate_with_calculator(engine, tokenizer, prompts[i], params, max_calls=max_tool_calls)
            else:
                out = await engine.generate(prompts[i], params)
            fault_point("eval")  # chaos suite: a kill during the held-out evaluation
            if bar is not None:
                bar.advance(task)
            return i, out

        return await asyncio.gather(*[one(i) for i in range(len(samples)) for _ in range(n)])

    t0 = time.perf_counter()
    if progress:
        bar, task = _progress_bar(dataset, total)
        with bar:
            outs = asyncio.run(run_all(bar, task))
    else:
        outs = asyncio.run(run_all())
    wall = time.perf_counter() - t0

    by_problem: dict[int, list] = {}
    for i, out in outs:
        by_problem.setdefault(i, []).append(out)
    # one isolated worker call per response (the metrics only, never the service's reward)
    pairs = [(o.text, s) for i, s in enumerate(samples) for o in by_problem[i]]
    t_check = time.perf_counter()
    checks = iter(_graded(service, pairs, grader))
    check_seconds = time.perf_counter() - t_check
    rewards: list[float | None] = []
    records = []
    p1, pk = [], {str(kk): [] for kk in _ks(n, k)}
    n_fmt = n_tok = n_correct_all = n_unknown = 0
    extra: dict[str, list[float]] = {}  # the service's further metrics (e.g. style verdicts)
    for i, s in enumerate(samples):
        resps = by_problem[i]
        verdicts: list[bool | None] = []
        fmts: list[bool | None] = []
        problem_rewards: list[float | None] = []
        for _ in resps:
            m = next(checks)
            verdicts.append(None if m.get("correct") is None else m["correct"] >= 1.0)
            fmts.append(None if m.get("format_ok") is None else m["format_ok"] >= 1.0)
            problem_rewards.append(m.pop("reward", None))
            for key, v in m.items():
                if key not in ANSWER_METRICS and v is not None:
                    extra.setdefault(key, []).append(float(v))
        rewards += problem_rewards
        c = sum(v is True for v in verdicts)
        n_unknown += sum(v is None for v in verdicts)
        n_correct_all += c
        n_fmt += sum(f is True for f in fmts)
        n_tok += sum(len(o.token_ids) for o in resps)
        p1.append(c / n)
        for kk in pk:
            pk[kk].append(pass_at_k(n, c, int(kk)))
        records.append({
            "id": s.id, "answer": s.answer, "correct": verdicts, "format_ok": fmts,
            "responses": [o.text for o in resps],
            **({"rewards": problem_rewards} if grader is not None else {}),
        })
    gen_tokens = n_tok
    scored = [r for r in rewards if r is not None]
    if grader is not None:
        graded = dict(reward_fn=grader.reward_fn, pass_definition=grader.pass_definition,
                      pass_threshold=None if grader.correct_metric else grader.threshold, graders=grader.graders(),
                      reward_failures=len(rewards) - len(scored),
                      reward_mean=sum(scored) / len(scored) if scored else None)
    else:
        style = "style_cute" in getattr(service, "metric_names", ())  # the preference-shift task's judge
        rule = f"correct >= 1.0: {STYLE_CHECKER if style else BUILTIN_CHECKER}"
        fmt = "conveyor.rewards.styles:quality_reward" if style else FORMAT_GRADER
        graded = dict(pass_definition=rule, graders={"pass_at_1": rule, "pass_at_k": rule, "avg_at_k": rule,
                                                     "format_rate": fmt, "reward_mean": None})
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
        check_seconds=check_seconds,
        temperature=params.temperature,
        max_new_tokens=params.max_new_tokens,
        top_p=params.top_p,
        tool=tool,
        max_tool_calls=max_tool_calls,
        instruction=instruction,
        correct_unknown=n_unknown,
        metrics_mean={key: sum(v) / len(v) for key, v in sorted(extra.items())},
        records=records,
        **graded,
    )


def _progress_bar(dataset: str, total: int):
    """A rich progress bar for :func:`evaluate` (a context manager) and its task."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn("eval {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
    return bar, bar.add_task(dataset or "", total=total)


def _run_episodes(engine, tokenizer, samples, params, service, env, *, n, k, dataset, model_name, progress,
                  instruction) -> EvalResult:
    """:func:`evaluate` with an environment: ``n`` episodes per sample
    (:class:`~conveyor.rollout.agent.AgentWorkflow`, or
    :class:`~conveyor.rollout.openai_agent.OpenAIAgentWorkflow` for ``openai:...``), then the figures."""
    from conveyor.envs.registry import build_env_workflow

    # AgentWorkflow, or the OpenAI-client agent's workflow (env.name=openai:...; closed below)
    workflow = build_env_workflow(env, tokenizer=tokenizer, reward_service=service, params=params, group_size=n,
                                  instruction=instruction or "")
    try:
        return _episode_figures(workflow, engine, samples, params, env, n=n, k=k, dataset=dataset,
                                model_name=model_name, progress=progress, instruction=instruction)
    finally:
        close = getattr(workflow, "close", None)
        if close is not None:
            close()


def _episode_figures(workflow, engine, samples, params, env, *, n, k, dataset, model_name, progress,
                     instruction) -> EvalResult:
    """The episodes of :func:`_run_episodes` and their figures."""
    from conveyor.envs.sandbox import INCIDENT_KINDS

    failures: list[tuple[str, BaseException]] = []

    async def run_all(bar=None, task=None):
        async def one(s):
            try:
                trajs = await workflow.run_episode(engine, s)
            except Exception as e:  # noqa: BLE001 - the agent's or environment's own error: counted, not fatal
                failures.append((s.id, e))
                if len(failures) == 1:
                    log.warning("evaluate: the episodes of %s failed (counted as wrong; further failures "
                                "in one line each)", s.id, exc_info=e)
                else:
                    log.warning("evaluate: the episodes of %s failed: %s: %s", s.id, type(e).__name__, e)
                trajs = e
            else:
                if trajs is None:
                    raise RuntimeError(f"evaluate: an episode of {s.id} was aborted (the engine stopped)")
                fault_point("eval")
            if bar is not None:
                bar.advance(task, n)
            return trajs

        return await asyncio.gather(*[one(s) for s in samples])

    t0 = time.perf_counter()
    if progress:
        bar, task = _progress_bar(dataset, len(samples) * n)
        with bar:
            groups = asyncio.run(run_all(bar, task))
    else:
        groups = asyncio.run(run_all())
    wall = time.perf_counter() - t0
    if failures and len(failures) == len(samples):
        sid, first = failures[0]
        from conveyor.rollout.controller import EpisodesFailedError

        raise EpisodesFailedError(f"evaluate: the episodes of every problem failed ({len(samples)} of {len(samples)}; "
                           f"the first, {sid}: {type(first).__name__}: {first}); no figure to report") from first

    records = []
    p1, pk = [], {str(kk): [] for kk in _ks(n, k)}
    n_fmt = n_tok = n_action_tok = n_correct = n_unknown = n_cut = 0
    turns = calls = calls_ok = 0
    rewards: list[float] = []
    incidents: dict[str, int] = {}  # every kind once an episode reports sandbox incidents
    for s, trajs in zip(samples, groups, strict=True):
        if isinstance(trajs, BaseException):  # the group raised: n failed episodes, each wrong
            p1.append(0.0)
            for kk in pk:
                pk[kk].append(0.0)
            records.append({"id": s.id, "answer": s.answer, "correct": [False] * n,
                            "error": f"{type(trajs).__name__}: {trajs}"[:500]})
            continue
        verdicts = [t.correct for t in trajs]
        c = sum(v is True for v in verdicts)
        n_correct += c
        n_unknown += sum(v is None for v in verdicts)
        n_fmt += sum(t.metadata.get("format_ok") is True for t in trajs)
        n_tok += sum(len(t.response_ids) for t in trajs)
        n_action_tok += sum(sum(t.action_mask) if t.action_mask is not None else len(t.response_ids) for t in trajs)
        p1.append(c / n)
        for kk in pk:
            pk[kk].append(pass_at_k(n, c, int(kk)))
        stats = [t.metadata.get("env_stats") or {} for t in trajs]
        for t, st in zip(trajs, stats, strict=True):
            turns += t.metadata.get("turns", 0)
            calls += st.get("tool_calls", 0)
            calls_ok += st.get("tool_calls_ok", 0)
            n_cut += not t.metadata.get("env_done", True)
            rewards.append(float(t.reward))
            if "incidents" in st and not incidents:
                incidents = dict.fromkeys(INCIDENT_KINDS, 0)
            for kind, v in (st.get("incidents") or {}).items():
                incidents[kind] = incidents.get(kind, 0) + int(v)
        records.append({
            "id": s.id, "answer": s.answer, "correct": verdicts,
            "format_ok": [t.metadata.get("format_ok") for t in trajs],
            "responses": [t.text for t in trajs],
            "turns": [t.metadata.get("turns", 0) for t in trajs],
            "rewards": [float(t.reward) for t in trajs],
            "env_stats": stats,
            # the first episode's exact tokens (observations included, never re-encoded): conveyor inspect
            "episode_ids": {"prompt": list(trajs[0].prompt_ids), "response": list(trajs[0].response_ids),
                            "action_mask": (None if trajs[0].action_mask is None else
                                            [int(m) for m in trajs[0].action_mask])},
        })
    total = len(samples) * n
    done = total - len(failures) * n  # episodes that ran to an end: the means of what episodes did
    return EvalResult(
        dataset=dataset, model=model_name, num_problems=len(samples), samples_per_problem=n,
        pass_at_1=sum(p1) / len(p1), pass_at_k={kk: sum(v) / len(v) for kk, v in pk.items()},
        avg_at_k=n_correct / total, format_rate=n_fmt / total, mean_response_tokens=n_tok / done,
        tokens_per_second=n_action_tok / wall if wall > 0 else math.nan, wall_seconds=wall,
        temperature=params.temperature, max_new_tokens=params.max_new_tokens, top_p=params.top_p,
        tool="none", instruction=instruction, correct_unknown=n_unknown, records=records,
        env=env.name, max_turns=env.max_turns, max_episode_tokens=env.max_episode_tokens,
        tool_format=env.tool_format, env_options=dict(env.options),
        turns_mean=turns / done, tool_calls_mean=calls / done, tool_call_rate=calls / turns if turns else 0.0,
        tool_call_success_rate=calls_ok / calls if calls else None, sandbox_incidents=incidents,
        reward_mean=sum(rewards) / done, episodes_cut=n_cut,
        episodes_failed=len(failures) * n,
        pass_definition=f"the environment's verdict (env.name={env.name}: correct reported by its episodes)",
        graders={"pass_at_1": f"the environment's verdict (env.name={env.name})",
                 "pass_at_k": f"the environment's verdict (env.name={env.name})",
                 "avg_at_k": f"the environment's verdict (env.name={env.name})",
                 "format_rate": f"the environment's format_ok (env.name={env.name})",
                 "reward_mean": f"the environment's episode rewards (env.name={env.name})"},
    )
