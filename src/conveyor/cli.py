"""The ``conveyor`` command line (typer)."""

from __future__ import annotations

import json
import logging
import os
import sys

# Two OpenMP pools (engine thread, trainer thread) share the cores; spinning idle workers would
# slow both down by an order of magnitude. Must be set before torch initialises OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="conveyor: asynchronous RL post-training of LLMs (train, eval, datasets, report, inspect, simulate, serve).",
)


class _Console(Console):
    """The commands' console: when its reader goes away (``conveyor train ... | head``, a
    ``tee`` or a pipe reader killed), console output stops and the command goes on; rich's
    default raises ``SystemExit(1)`` from inside the print, which killed a training run
    mid-step without its checkpoint (fresh-user trial 4, finding 2). ``train.log`` keeps every
    line."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            out = os.fstat(sys.stdout.fileno())
            same = [fd for fd in (2,) if (os.fstat(fd).st_ino, os.fstat(fd).st_dev) == (out.st_ino, out.st_dev)]
        except (OSError, ValueError):
            out, same = None, []
        for fd in ([sys.stdout.fileno()] if out is not None else []) + same:  # the broken pipe's ends: devnull
            os.dup2(devnull, fd)
        os.close(devnull)
        logging.getLogger("conveyor").warning(
            "the console's reader went away (broken pipe): console output stops here, the command goes on "
            "(train.log keeps every line)", extra={"console": False})


console = _Console()


def _engine_options(device: str, init: str):
    """``--device`` resolved for an engine (:func:`conveyor.devices.resolve`) after ``--init`` is
    checked; exits with one line naming the flag otherwise."""
    from conveyor.devices import resolve

    if init not in ("pretrained", "random"):
        _fail(f"--init must be pretrained or random, got {init!r}")
    try:
        return resolve(device, "--device", role="engine")
    except ValueError as e:
        _fail(str(e))


def _slug(text: str) -> str:
    """A file-name-safe version of a model / dataset reference."""
    import re

    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text.strip("/")).strip("_")[:120] or "x"


def _fail(msg: str, code: int = 2) -> None:
    from rich.markup import escape

    # the message is plain text: no markup, no emoji codes (a spec like gsm8k:train: is not one)
    console.print(f"[bold red]error:[/] {escape(msg)}", emoji=False)
    raise typer.Exit(code)


# instruction None: the data source's own (conveyor.prompts.resolve_instruction)
_EVAL_DEFAULTS = {"dataset": "mawps:singleop", "temperature": 0.0, "top_p": 1.0,
                  "max_new_tokens": 128, "instruction": None, "split_seed": 0, "tool": "none",
                  "max_tool_calls": 4, "samples": None}
_EXPORT = "a run's export (RUN/export)"
_EVAL_HELP = {
    "dataset": "dataset spec, e.g. mawps:singleop, gsm8k:test, svamp, rg:basic_arithmetic "
               f"(default: {_EXPORT}: the run's held-out set; else mawps:singleop)",
    "n": f"evaluate the first N problems (default: all; {_EXPORT}: the run's data.heldout_limit)",
    "temperature": f"0 = greedy (default: 0; {_EXPORT}: its held-out evaluation's, run.eval_temperature)",
    "top_p": "(default: 1.0)",
    "max_new_tokens": f"tokens (default: 128; {_EXPORT}: its run.eval_max_new_tokens)",
    "instruction": f"appended to every question (default: {_EXPORT}: its data.instruction; "
                   "else the data source's own)",
    "split_seed": f"(default: 0; {_EXPORT}: its data.split_seed)",
    "tool": "none, or calculator: results of 'a op b =' are inserted (rollout.tool) "
            f"(default: {_EXPORT}: its rollout.tool; else none)",
    "max_tool_calls": "calculator observations per response at most "
                      f"(default: 4; {_EXPORT}: its rollout.max_tool_calls)",
    "reward": "grade with this reward function (module:fn, or a built-in name: math, correctness, format, style): "
              "reports reward_mean, and pass@1 = the share with reward >= --pass-threshold, or the function's own "
              "correct metric (fn.correct) when it has one (default: a run's export graded by the run's reward.fn, "
              "when not a built-in; else the built-in answer checker)",
    "pass_threshold": "with --reward: the reward a response needs to pass (default 1.0; a run's export: its "
                      "reward.pass_threshold)",
    "env": "run an environment's episodes instead of single responses: guess, math_python, "
           "package.module:factory or openai:package.module:fn (an openai-client agent) "
           f"(env.name; default: {_EXPORT}: its env; else none); reports turns, "
           "tool calls and sandbox incidents too",
    "max_turns": "model turns per episode at most (env.max_turns, default 4)",
    "max_episode_tokens": "response tokens per episode at most (env.max_episode_tokens, default 512)",
    "tool_format": "auto, hermes or fenced (env.tool_format, default auto)",
    "env_option": "KEY=VALUE passed to the environment (env.options), repeatable, e.g. --env-option high=10 "
                  "(guess: the games' range, also written into a guess dataset spec without high=)",
}


def _env_settings(exported: dict | None, flags: dict):
    """The ``env`` section for ``conveyor eval``: an export's ``env`` (``conveyor.json``) unless
    ``--env`` names another environment, then the explicit flags on top. None: no environment."""
    from conveyor.config import ConfigError, EnvConfig, _parse_value

    base: dict = {}
    if exported and (flags["env"] is None or flags["env"] == exported.get("name")):
        base = dict(exported)
    if flags["env"] is not None:
        base["name"] = flags["env"]
    if not base or base.get("name") in (None, "none"):
        if any(flags[k] is not None for k in ("max_turns", "max_episode_tokens", "tool_format")) or flags["env_option"]:
            _fail("--max-turns, --max-episode-tokens, --tool-format and --env-option need --env")
        return None
    for key in ("max_turns", "max_episode_tokens", "tool_format"):
        if flags[key] is not None:
            base[key] = flags[key]
    options = dict(base.get("options") or {})
    for item in flags["env_option"] or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            _fail(f"--env-option {item!r} must look like KEY=VALUE")
        options[key.strip()] = _parse_value(value.strip())
    base["options"] = options
    from pydantic import ValidationError

    from conveyor.config import format_validation_error

    try:
        return EnvConfig.model_validate(base)
    except ValidationError as e:  # one line per key, as `conveyor train`'s config errors
        src = (("the export's env and " if exported else "")
               + "--env, --max-turns, --max-episode-tokens, --tool-format, --env-option")
        raise ConfigError(format_validation_error(e, src, what="environment settings")) from e


def _eval_settings(model: str, flags: dict) -> tuple[dict, str | None]:
    """``conveyor eval``'s settings: each explicit flag (not None), else the model's export
    settings (``conveyor.json`` of ``RUN/export``: the run's held-out evaluation), else the
    built-in default (:data:`_EVAL_DEFAULTS`). Returns the settings and the settings file used."""
    from conveyor.eval import EXPORT_SETTINGS_FILE, load_export_settings

    try:
        exp = load_export_settings(model)
    except ValueError as e:
        _fail(str(e))
    out = dict(_EVAL_DEFAULTS, n=None)
    if exp is not None:
        ev = exp.get("eval") or {}
        for key in ("temperature", "top_p", "max_new_tokens", "split_seed", "samples"):
            if ev.get(key) is not None:
                out[key] = ev[key]
        for key in ("instruction", "tool", "max_tool_calls"):
            if exp.get(key) is not None:
                out[key] = exp[key]
        if flags["dataset"] is None and ev.get("dataset"):  # the run's held-out problems
            out["dataset"], out["n"] = ev["dataset"], ev.get("limit")
    for key, value in flags.items():
        if value is not None:
            out[key] = value
    from conveyor.prompts import resolve_instruction

    out["instruction"] = resolve_instruction(out["instruction"], out["dataset"])
    return out, (str(Path(model) / EXPORT_SETTINGS_FILE) if exp is not None else None)


def _eval_reward(reward: str | None, threshold: float | None, exported: dict, env_cfg):
    """``conveyor eval``'s reward grader: ``--reward`` (and ``--pass-threshold``), else the
    export's ``reward.heldout_grader`` (the run graded its held-out figure with its own
    ``reward.fn``) and its ``pass_threshold``; None: the built-in answer checker.
    Prints which grader decides pass@1. Fails on a reward function that cannot be loaded, a
    reward with an environment, and ``--pass-threshold`` without a reward."""
    from rich.markup import escape

    from conveyor.eval import reward_grader

    exp = exported.get("reward") or {}
    fn = reward if reward is not None else exp.get("heldout_grader")
    if fn is None:
        if threshold is not None:
            _fail("--pass-threshold needs --reward (the built-in checker grades right or wrong)")
        return None
    if env_cfg is not None:
        if reward is not None:
            _fail(f"--reward {reward} with --env {env_cfg.name}: the environment's episodes report their own "
                  "verdict and reward")
        return None
    if threshold is None:
        threshold = exp.get("pass_threshold", 1.0) if reward is None or reward == exp.get("heldout_grader") else 1.0
    try:
        grader = reward_grader(fn, threshold)
    except ValueError as e:
        _fail(f"--reward {fn}: {e}" if reward is not None else
              f"the export's reward.fn {fn} (the run's held-out grader; --reward overrides): {e}")
    src = "" if reward is not None else " (the run's reward.fn, from the export's conveyor.json)"
    console.print(f"grading with reward {escape(fn)}{escape(src)}: pass@1 counts {escape(grader.pass_definition)}",
                  soft_wrap=True)
    return grader


@app.command("eval")
def eval_cmd(
    model: Annotated[str, typer.Option(help="preset (smollm2-135m-instruct, tiny), HF directory, .gguf file, or a "
                                            "run's export RUN/export (a run directory RUN: its export)")] = "smollm2-135m-instruct",
    dataset: Annotated[str | None, typer.Option(help=_EVAL_HELP["dataset"])] = None,
    n: Annotated[int | None, typer.Option("--n", help=_EVAL_HELP["n"])] = None,
    k: Annotated[int, typer.Option("--k", help="k of pass@k (>= 1)")] = 1,
    samples: Annotated[int | None, typer.Option(help="samples per problem (>= k, default k; "
                                                     f"{_EXPORT}: its run.eval_samples)")] = None,
    temperature: Annotated[float | None, typer.Option(help=_EVAL_HELP["temperature"])] = None,
    top_p: Annotated[float | None, typer.Option(help=_EVAL_HELP["top_p"])] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help=_EVAL_HELP["max_new_tokens"])] = None,
    instruction: Annotated[str | None, typer.Option(help=_EVAL_HELP["instruction"])] = None,
    split_seed: Annotated[int | None, typer.Option(help=_EVAL_HELP["split_seed"])] = None,
    batch_size: Annotated[int, typer.Option(help="engine decode batch (sequences)")] = 32,
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[str, typer.Option(help="where the engine runs: auto (a GPU when one is seen), cpu, cuda, "
                                             "cuda:N")] = "auto",
    init: Annotated[str, typer.Option(help="pretrained (the model's weights) or random (its config.json's "
                                           "architecture with random weights: speed measurements)")] = "pretrained",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="JSON output path")] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress")] = False,
    tool: Annotated[str | None, typer.Option(help=_EVAL_HELP["tool"])] = None,
    max_tool_calls: Annotated[int | None, typer.Option(help=_EVAL_HELP["max_tool_calls"])] = None,
    reward: Annotated[str | None, typer.Option(help=_EVAL_HELP["reward"])] = None,
    pass_threshold: Annotated[float | None, typer.Option(help=_EVAL_HELP["pass_threshold"])] = None,
    env: Annotated[str | None, typer.Option(help=_EVAL_HELP["env"])] = None,
    max_turns: Annotated[int | None, typer.Option(help=_EVAL_HELP["max_turns"])] = None,
    max_episode_tokens: Annotated[int | None, typer.Option(help=_EVAL_HELP["max_episode_tokens"])] = None,
    tool_format: Annotated[str | None, typer.Option(help=_EVAL_HELP["tool_format"])] = None,
    env_option: Annotated[list[str] | None, typer.Option(help=_EVAL_HELP["env_option"])] = None,
    engine_name: Annotated[str, typer.Option("--engine", help="what generates: local (conveyor's engine) or vllm (a "
                                                               "vLLM server on the model's directory, started and "
                                                               "stopped here, or --vllm-url)")] = "local",
    vllm_url: Annotated[str | None, typer.Option(help="--engine vllm: a running vLLM server instead of starting "
                                                      "one (it must serve the same model)")] = None,
    vllm_dtype: Annotated[str, typer.Option(help="--engine vllm: the started server's dtype (float32, bfloat16)")]
        = "float32",
) -> None:
    """Evaluate a model: pass@1, pass@k (Chen et al. 2021), avg@k, format rate, length, tokens/s;
    with --env, an environment's episodes (also turns, tool calls, sandbox incidents).

    A run's export (RUN/export) carries the settings of the run's held-out evaluation in
    conveyor.json (tool, instruction, held-out data set, greedy decoding, max new tokens, the
    environment): they are the defaults, so the run's figure is reproduced; explicit flags
    override them. A run directory RUN given as --model evaluates RUN/export (said so); a run
    without an export is refused.
    """
    from rich.markup import escape

    from conveyor.config import ConfigError
    from conveyor.data import DatasetError, load_dataset
    from conveyor.eval import (
        EXPORT_SETTINGS_FILE,
        evaluate,
        load_export_settings,
        resolve_eval_model,
    )
    from conveyor.models import ModelLoadError, load_model
    from conveyor.rollout.controller import EpisodesFailedError
    from conveyor.rollout.engine import InferenceEngine, SamplingParams
    from conveyor.runtime_files import RunFileError, check_output_file

    if k < 1:
        _fail(f"--k must be an integer >= 1 (the k of pass@k), got {k}")
    if samples is not None and samples < k:
        _fail(f"--samples must be >= --k (n responses per problem for pass@k, default: --k); "
              f"got --samples {samples} with --k {k}")
    try:
        model, note = resolve_eval_model(model)
    except ValueError as e:
        _fail(str(e))
    if note is not None:
        console.print(f"[bold yellow]note:[/] {escape(note)}", emoji=False, soft_wrap=True)
    try:
        exported = load_export_settings(model) or {}
        exported_env = exported.get("env")
        env_cfg = _env_settings(exported_env, {"env": env, "max_turns": max_turns,
                                               "max_episode_tokens": max_episode_tokens,
                                               "tool_format": tool_format, "env_option": env_option})
    except (ValueError, ConfigError) as e:
        _fail(str(e))
    dataset_flag = dataset
    if env_cfg is not None and dataset is None and not exported_env:
        from conveyor.envs.registry import ENV_DATA

        if env_cfg.name in ENV_DATA:  # e.g. guess: its own games, not the maths default
            dataset = ENV_DATA[env_cfg.name][1]
    tool_flag = tool
    st, settings_from = _eval_settings(model, {
        "dataset": dataset, "n": n, "temperature": temperature, "top_p": top_p,
        "max_new_tokens": max_new_tokens, "instruction": instruction, "split_seed": split_seed,
        "tool": tool, "max_tool_calls": max_tool_calls, "samples": samples})
    dataset, n, temperature, top_p = st["dataset"], st["n"], st["temperature"], st["top_p"]
    max_new_tokens, instruction = st["max_new_tokens"], st["instruction"]
    samples = st["samples"] if st["samples"] is None or st["samples"] >= k else samples  # the export's, if >= --k
    split_seed, tool, max_tool_calls = st["split_seed"], st["tool"], st["max_tool_calls"]
    if env_cfg is not None and env_cfg.name == "guess":  # --env-option high=H: the range the games play
        from conveyor.envs.guess import check_guess_options, guess_spec_for

        try:
            check_guess_options(env_cfg.options)
            high_flag = any(o.partition("=")[0].strip() == "high" for o in env_option or [])
            dataset = guess_spec_for(
                dataset, env_cfg.options.get("high"),
                "--dataset" if dataset_flag is not None
                else "dataset" if settings_from is None else f"the dataset of {settings_from}",
                *(("--env-option high", None) if high_flag or not exported_env or exported_env.get("name") != "guess"
                  else ("env.options.high", str(Path(model) / EXPORT_SETTINGS_FILE))))
        except ValueError as e:
            _fail(str(e))
    grader = _eval_reward(reward, pass_threshold, exported, env_cfg)
    if env_cfg is not None and tool != "none":
        if tool_flag not in (None, "none"):
            _fail(f"--tool {tool} is the single-turn calculator; with --env {env_cfg.name} the environment brings "
                  "its own tools: drop --tool (or --tool none)")
        tool = "none"  # an export's rollout.tool default belongs to single responses
    if settings_from is not None:
        console.print(f"settings from {settings_from} (flags override): dataset {dataset}"
                      f"{'' if n is None else f' (first {n})'}, tool {tool}, "
                      f"max_new_tokens {max_new_tokens}, temperature {temperature}"
                      f"{'' if env_cfg is None else f', env {env_cfg.name}'}", soft_wrap=True)
    if batch_size < 1:
        _fail(f"--batch-size must be >= 1, got {batch_size}")
    if n is not None and n < 1:  # checked before the model loads (fresh-user trial 5)
        _fail(f"--n must be >= 1 (the first N problems), got {n}")
    if tool not in ("none", "calculator"):
        _fail(f"--tool must be none or calculator, got {tool!r}")
    env_part = "" if env_cfg is None else f"__env_{_slug(env_cfg.name)}"
    init_part = "" if init == "pretrained" else f"__init_{_slug(init)}"  # never overwrites the model's own figure
    init_part += "" if reward is None else f"__reward_{_slug(reward)}"  # nor the built-in checker's
    out = output or Path("runs") / "eval" / f"{_slug(model)}__{_slug(dataset)}{env_part}{init_part}.json"
    try:
        check_output_file(out, "--output")
    except RunFileError as e:
        _fail(str(e))
    engine_device = _engine_options(device, init)
    try:
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    except ValueError as e:
        _fail(str(e))
    if temperature == 0 and (samples or k) > 1:
        console.print("[yellow]note:[/] temperature 0 is greedy: all samples of a problem are identical")
    try:
        data = load_dataset(dataset, split_seed=split_seed, limit=n)
    except DatasetError as e:
        _fail(str(e))
    try:
        lm = load_model(model, init=init)
    except (ModelLoadError, ValueError) as e:
        _fail(str(e))
    console.print(f"model {model}{' (random weights)' if init == 'random' else ''} loaded in "
                  f"{lm.load_seconds:.1f} s; {len(data)} problems of {dataset}; engine on {engine_device}")
    if env_cfg is not None:
        from conveyor.envs.registry import check_env

        try:
            for note in check_env(env_cfg, lm.tokenizer):
                console.print(note, soft_wrap=True)
        except (ValueError, TypeError) as e:
            _fail(str(e))
    style = exported.get("style") if init == "pretrained" else None
    reward_service = None
    if style:  # a preference-shift run's export: judged as its own held-out evaluation (fresh-user trial 5)
        from conveyor.rewards import RewardService
        from conveyor.rewards.styles import service_metrics
        from conveyor.rollout.style_schedule import stamp_target_style

        try:
            data = [stamp_target_style(s, style["target"], exported.get("policy_version")) for s in data]
            reward_service = RewardService("style", metrics=service_metrics(style["schedule"]))
        except (ImportError, ValueError, KeyError) as e:
            _fail(f"{Path(model) / EXPORT_SETTINGS_FILE}: the preference-shift task's style judge: {e}")
        console.print(f"style task: pass@1 is the share judged in {style['target']} (the target at version "
                      f"{exported.get('policy_version')}); metrics_mean has the share judged in each style",
                      soft_wrap=True)
    if engine_name == "vllm":
        from conveyor.models import resolve_model_dir
        from conveyor.rollout.engine.vllm import VllmEngine, VllmServer, VllmServerError

        server = None if vllm_url else VllmServer(str(resolve_model_dir(model)), dtype=vllm_dtype,
                                                  max_num_seqs=batch_size, seed=seed)
        engine = VllmEngine(vllm_url, server=server, tokenizer=lm.tokenizer)
        try:
            engine.start()
        except (VllmServerError, OSError, RuntimeError) as e:
            engine.close()
            _fail(str(e))
        except BaseException:  # Ctrl-C while the server starts: never leave it running
            engine.close()
            raise
    elif engine_name == "local":
        engine = InferenceEngine(lm.model, lm.tokenizer, max_batch_size=batch_size, seed=seed, device=engine_device)
        engine.start()
    else:
        _fail(f"--engine must be local or vllm, got {engine_name!r}")
    try:
        res = evaluate(
            engine, lm.tokenizer, data, k=k, samples_per_problem=samples, temperature=temperature, top_p=top_p,
            max_new_tokens=max_new_tokens, instruction=instruction, dataset=dataset, model_name=model,
            progress=not no_progress and console.is_terminal, tool=tool,
            max_tool_calls=max_tool_calls, env=env_cfg, reward_service=reward_service,
            **({} if grader is None else {"reward_fn": grader.reward_fn, "pass_threshold": grader.threshold}),
        )
    except ValueError as e:
        _fail(str(e))
    except EpisodesFailedError as e:  # a broken agent / environment: no figure (the first traceback above)
        _fail(str(e), code=1)
    finally:
        engine.stop()
        if engine_name == "vllm":
            engine.close()  # a server started here stops with it
        if reward_service is not None:
            reward_service.close()
    res.settings_from, res.split_seed, res.init = settings_from, split_seed, init
    # a run's export: the version it holds (random weights hold none)
    res.policy_version = exported.get("policy_version") if init == "pretrained" else None
    summ = res.summary()
    console.print_json(json.dumps(summ))
    try:
        res.write_json(out)
    except RunFileError as e:  # the figures are above; the per-problem records could not be kept
        _fail(f"{e} (the summary above is the result; the per-problem records were not written)", code=1)
    console.print(f"written to {out}", soft_wrap=True)


@app.command("train")
def train_cmd(
    config: Annotated[Path | None, typer.Argument(help="YAML/JSON config file (default: built-in defaults)")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides, e.g. async.eta=4 trainer.lr=1e-5")] = None,
    resume: Annotated[Path | None, typer.Option(help="continue the run in this directory from its last checkpoint")] = None,
    quiet: Annotated[bool, typer.Option(help="less console output")] = False,
) -> None:
    """Asynchronous RL training (default: SmolLM2-135M-Instruct on MAWPS singleop, eta = 2)."""
    from conveyor.config import ConfigError, load_config
    from conveyor.data import DatasetError
    from conveyor.models import ModelLoadError
    from conveyor.rewards.guard import RewardsFailedError
    from conveyor.rollout.controller import EpisodesFailedError
    from conveyor.runlog import console_log_handler
    from conveyor.runtime.ray import RayConnectError, RolloutActorError  # (imports no Ray)
    from conveyor.runtime_files import RunFileError, describe_os_error, is_disk_full
    from conveyor.shutdown import StopNow
    from conveyor.train import load_run_config, run_training
    from conveyor.trainer.trainer import NonFiniteLossError

    ov = list(overrides or [])
    if config is not None and "=" in str(config):  # `conveyor train key=value` without a file
        ov.insert(0, str(config))
        config = None
    if resume and config is None:  # `--resume RUN key=value file.yaml`: the file came after an override
        from conveyor.config import CONFIG_FILE_SUFFIXES

        config = next((Path(o) for o in ov if "=" not in o and Path(o).suffix.lower() in CONFIG_FILE_SUFFIXES), None)
    if resume and config is not None:
        _fail(f"--resume uses the run's saved config; pass changes as key=value overrides, not a file ({config})")
    if config is not None and not config.exists():  # a shipped preset: `conveyor train sao` from anywhere
        config = _preset_or_fail(config)
    try:
        cfg = load_run_config(resume, ov) if resume else load_config(config, ov)
    except (ConfigError, FileNotFoundError) as e:
        _fail(str(e))
    # the console gets one line per warning (no tracebacks, no individual reward failures: a
    # count); train.log in the run directory gets everything
    handler = logging.FileHandler("/dev/null") if quiet else console_log_handler()
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request to a remote engine otherwise
    from conveyor.rollout.engine.remote import EngineHTTPError
    from conveyor.rollout.engine.vllm import VllmServerError

    try:
        res = run_training(cfg, resume_dir=resume, console=console)
    except (FileExistsError, FileNotFoundError, ModelLoadError, DatasetError, ConfigError,
            RunFileError, VllmServerError) as e:
        _fail(str(e))
    except EngineHTTPError as e:  # a remote engine's server that cannot be reached at start or died
        _fail(str(e), code=1)
    except StopNow as e:  # a second Ctrl-C: threads and workers are stopped; say what was saved
        console.print(e.report, style="yellow", soft_wrap=True, markup=False, emoji=False)
        sys.exit(128 + int(e.signum or 2))  # the shell's convention: 130 SIGINT, 143 SIGTERM
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        sys.exit(130)
    except OSError as e:
        if is_disk_full(e):
            _fail(str(describe_os_error(e, "the run directory")))
        raise
    except NonFiniteLossError as e:
        _fail(f"{e}\nThe last state was checkpointed; see events.jsonl in the run directory.", code=1)
    except RewardsFailedError as e:  # reward.max_failed_steps: checkpointed first
        _fail(f"{e}\nThe last state was checkpointed; see train.log and events.jsonl in the run directory.",
              code=1)
    except RayConnectError as e:  # runtime.address unreachable, or a local cluster that cannot start
        _fail(str(e), code=1)
    except RolloutActorError as e:  # runtime.name=ray: the actor's message (its log: train.log)
        _fail(f"{e}\nSee train.log and events.jsonl in the run directory.", code=1)
    except EpisodesFailedError as e:  # a broken environment / agent (its options): checkpointed first
        _fail(f"{e}\nEvery episode's traceback is in train.log in the run directory; fix the cause and "
              "start again (or continue with conveyor train --resume RUN_DIR).", code=1)
    except (ValueError, ImportError, AttributeError, TypeError) as e:
        # bad reward.fn path, incompatible resume, Ray missing for runtime.name=ray, wandb
        # missing for log.wandb=true
        if ("reward" in str(e) or "--resume" in str(e) or "conveyor[ray]" in str(e)
                or "conveyor[wandb]" in str(e)):
            _fail(str(e))
        raise
    console.print(f"[bold]run directory:[/] {res.run_dir}  (steps {res.steps}, {res.wall_seconds:.0f} s, "
                  f"trainer busy {res.trainer_busy:.2f}, engine busy {res.engine_busy:.2f}"
                  + ("" if res.cpu_busy is None else f", cores busy {res.cpu_busy:.2f}") + ")")
    if res.heldout_before is not None or res.heldout_after is not None:
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        from conveyor.train import eval_decoding

        console.print(f"[bold]held-out pass@1 ({eval_decoding(cfg)}):[/] before {fmt(res.heldout_before)} "
                      f"-> after {fmt(res.heldout_after)}")
    if res.interrupted:
        by = f" by {res.stop_reason}'s stop action" if (res.stop_reason or "").startswith("monitor rule") else ""
        console.print(f"stopped early{by}; continue with: conveyor train --resume {res.run_dir}")
        # the shell's convention for a signal: 128 + its number (130 SIGINT, 143 SIGTERM); a
        # monitor stop is not a signal: 3
        sys.exit(3 if by else 128 + (res.signal or 2))


def _preset_or_fail(config: Path) -> Path:
    """The shipped preset ``config`` names (:func:`conveyor.presets.find_preset`; said on the
    console), else a failure naming the missing file and the presets."""
    from conveyor.presets import find_preset, list_presets

    preset = find_preset(config)
    if preset is None:
        names = ", ".join(list_presets()) or "none installed"
        _fail(f"config file {config} does not exist; the shipped presets (conveyor presets): {names}, e.g. "
              "conveyor train sao")
    console.print(f"preset {preset.stem}: {preset}", soft_wrap=True, markup=False)
    return preset


@app.command("presets")
def presets_cmd() -> None:
    """List the configuration presets shipped with conveyor (conveyor train NAME, from any
    directory; the files are the repository's configs/*.yaml)."""
    from conveyor.presets import list_presets, preset_description

    presets = list_presets()
    if not presets:
        _fail("no presets installed (conveyor/configs/ is missing from this installation)", code=1)
    width = max(len(n) for n in presets)
    for name, path in presets.items():
        console.print(f"{name:<{width}}  {preset_description(path)}", soft_wrap=True, markup=False)
    console.print(f"\nconveyor train NAME [key=value ...]; the files: {next(iter(presets.values())).parent}",
                  soft_wrap=True, markup=False)


@app.command("datasets")
def datasets_cmd() -> None:
    """List the data set specs: the vendored sets, the guess-the-number games, every reasoning-gym
    task, then the forms of your own files and Hugging Face datasets on disk."""
    from conveyor.data import list_datasets
    from conveyor.data.registry import GUESS_DEFAULT_SIZE
    from conveyor.envs.guess import GUESS_DEFAULT_HIGH

    console.print("[bold]vendored[/] (each also takes :train / :heldout, except gsm8k:train / "
                  "gsm8k:test)")
    for name in list_datasets():
        console.print(f"  {name}")
    console.print("[bold]guess-the-number games[/] (env.name=guess; generated, :heldout with another seed; "
                  f"defaults size={GUESS_DEFAULT_SIZE}, high={GUESS_DEFAULT_HIGH}, seed=0)", soft_wrap=True)
    for part in ("train", "heldout"):
        console.print(f"  guess:{part}?size=N&high=H&seed=S", soft_wrap=True)
    try:
        rg = [n for n in list_datasets(include_rg=True) if n.startswith("rg:")]
    except ImportError as e:  # reasoning-gym not installed
        rg = []
        console.print(f"reasoning-gym tasks: unavailable ({e})")
    if rg:
        console.print(f"[bold]reasoning-gym[/] ({len(rg)} procedural tasks; "
                      "rg:<task>?size=N&seed=S, "
                      ":train / :heldout use disjoint seeds)")
        for name in rg:
            console.print(f"  {name}")
    console.print("[bold]your own file[/]: file:/path/data.jsonl?question=FIELD&answer=FIELD "
                  "(JSONL, JSON or parquet)",
                  soft_wrap=True)
    console.print("[bold]a Hugging Face dataset on disk[/]: hf:/path/to/saved[:SPLIT]"
                  "?question=FIELD&answer=FIELD (save_to_disk output or a local dataset "
                  "repository; read offline, never downloaded)",
                  soft_wrap=True)


@app.command("report")
def report_cmd(run_dir: Path) -> None:
    """Redraw the report PNG of a run directory."""
    from conveyor.runlog import plot_report
    from conveyor.runtime_files import RunFileError

    try:
        console.print(str(plot_report(run_dir)))
    except (FileNotFoundError, RunFileError) as e:
        _fail(str(e))


_INSPECT_LEGEND = (
    "how to read a link 'Step s: Token j \"a\" -> Token i \"b\"  w%': target token i (\"b\", decoded) gives "
    "w% of its attention in this layer to source token j (\"a\"), i's s-th strongest link (s = 1..{top}); "
    "positions count from the first prompt token (prompt 0..{last}, response {first}..), and a target's "
    "weights are normalised over the tokens 0..i it can see")


def _inspect_summary(res, top: int, all_links: bool) -> list[str]:
    """``conveyor inspect``'s short summary: the most attended source tokens (their mean share of
    a response token's attention, over the listed links) and the strongest links into response
    tokens; a last line says how to get the full list (``--all``)."""
    import json as _json

    def tok(i: int) -> str:
        return f"Token {i} {_json.dumps(res.labels[i], ensure_ascii=False)}"

    links = [ln for lns in res.links.values() for ln in lns]
    n = max(1, len(res.links))
    share: dict[int, float] = {}
    for ln in links:
        share[ln.source] = share.get(ln.source, 0.0) + ln.weight / n
    out = [f"summary over the response's {len(res.links)} tokens:",
           f"  most attended tokens (mean share of a response token's attention, counted in its top {top} links):"]
    out += [f"    {tok(j)}  {100.0 * w:.2f}%" for j, w in sorted(share.items(), key=lambda kv: (-kv[1], kv[0]))[:5]]
    out.append("  strongest links:")
    out += [f"    {tok(ln.source)} -> {tok(ln.target)}  {100.0 * ln.weight:.2f}%"
            for ln in sorted(links, key=lambda ln: (-ln.weight, ln.target, ln.source))[:10]]
    if not all_links:
        out.append(f"every response token's top {top} links ({len(links)} lines): --all; one token's: --target I")
    return out


@app.command("inspect")
def inspect_cmd(
    run_dir: Annotated[Path, typer.Argument(help="a conveyor train run directory (read only)")],
    sample: Annotated[int, typer.Option(help="record index in the run's latest held-out evaluation file")] = 0,
    layer: Annotated[int | None, typer.Option(help="layer 0..L-1 (default: the last)")] = None,
    head: Annotated[int | None, typer.Option(help="head 0..H-1 (default: the mean over heads)")] = None,
    top: Annotated[int, typer.Option(help="links per target token")] = 3,
    target: Annotated[int | None, typer.Option(help="one target token (position in prompt + response; default: every response token)")] = None,
    exclude_self: Annotated[bool, typer.Option("--exclude-self", help="leave out i -> i links, normalise over the rest")] = False,
    plot: Annotated[Path | None, typer.Option(help="save a heat map of the response tokens here (PNG)")] = None,
    all_links: Annotated[bool, typer.Option("--all", help="print every response token's links (default: a "
                                                           "summary of the strongest; --target prints its own)")]
        = False,
    values: Annotated[bool, typer.Option("--values", help="instead of attention: the critic's value before each "
                                                          "response token (a loss.advantage=gae run; policy and "
                                                          "critic from its newest intact checkpoint); the "
                                                          "attention options are ignored")] = False,
) -> None:
    """Attention inspection: the strongest links `Step s: Token j -> Token i  w%` of one held-out
    trajectory under the run's policy (export, else newest intact checkpoint, else the base
    model, said so), weights normalised per target token; one forward pass with eager attention.
    Says which policy version generated the trajectory and warns when it is not the version
    loaded. Prints what each field means, then a summary (the most attended tokens and the
    strongest links over the response); --all adds every response token's links.

    --values: the critic's values along the trajectory instead (a run trained with
    loss.advantage=gae; policy and critic from the newest intact checkpoint, whose step is
    named; an ensemble's mean and per-critic std): one line per response token (its value and
    the change from the previous token's), then the first and last values, the return and the
    largest rises and falls. --layer, --head, --top, --target, --exclude-self, --plot and --all
    are ignored there.
    """
    from rich.markup import escape

    from conveyor.data import DatasetError
    from conveyor.inspect_attention import InspectError, inspect_run, plot_attention
    from conveyor.models import ModelLoadError

    def note(msg: str) -> None:
        console.print(f"[bold yellow]note:[/] {escape(msg)}", emoji=False, soft_wrap=True)

    if values:
        from conveyor.inspect_values import format_values, inspect_values

        ignored = [name for name, v, d in (("--layer", layer, None), ("--head", head, None), ("--top", top, 3),
                                           ("--target", target, None), ("--exclude-self", exclude_self, False),
                                           ("--plot", plot, None), ("--all", all_links, False)) if v != d]
        if ignored:
            note(f"--values ignores {', '.join(ignored)} (attention options)")
        try:
            vres = inspect_values(run_dir, sample=sample, warn=note)
        except (FileNotFoundError, InspectError, ModelLoadError, DatasetError) as e:
            _fail(str(e))
        except (KeyError, RuntimeError, ValueError) as e:  # weights that do not fit the configured critic
            _fail(f"cannot load the critic of {run_dir}: {type(e).__name__}: {e}")
        lines = format_values(vres)
        for line in lines[:2]:
            console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
        if vres.version_warning is not None:
            console.print(f"[bold yellow]warning:[/] {escape(vres.version_warning)}", emoji=False, soft_wrap=True)
        for line in lines[2:]:
            console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
        return
    if plot is not None:  # before the forward pass: a file type matplotlib cannot write is refused now
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        kinds = FigureCanvasAgg.get_supported_filetypes()
        suffix = plot.suffix.lower().lstrip(".")
        if suffix not in kinds:
            _fail(f"--plot {plot}: {'no file type' if not suffix else f'.{suffix} is not an image type'}; "
                  f"use one of {', '.join('.' + k for k in sorted(kinds))} (e.g. --plot attention.png)")
    try:
        res = inspect_run(run_dir, sample=sample, layer=layer, head=head, top=top, target=target,
                          exclude_self=exclude_self, warn=note)
    except (FileNotFoundError, InspectError, ModelLoadError, DatasetError) as e:
        _fail(str(e))
    tr = res.trajectory
    head_txt = "mean over heads" if res.head is None else f"head {res.head}"
    verdict = {True: "correct", False: "wrong", None: "unknown"}[tr.correct]
    console.print(f"policy: {res.policy.source}", markup=False, soft_wrap=True)
    if tr.policy_version is None:
        generated = "by an unknown policy version"
    else:
        generated = f"by policy version {tr.policy_version}" + (
            "" if tr.version_source == "recorded" else f" ({tr.version_source.split(';')[0]})")
    console.print(f"trajectory: record {tr.index} of {tr.eval_file} ({tr.sample_id}, {verdict}), generated "
                  f"{generated}; prompt tokens 0..{res.prompt_len - 1}, response tokens "
                  f"{res.prompt_len}..{len(tr.ids) - 1} ("
                  f"{'the episode exactly as generated, observations included' if tr.exact_ids else 'the response text re-encoded'})",
                  markup=False, soft_wrap=True)
    if res.version_warning is not None:
        console.print(f"[bold yellow]warning:[/] {escape(res.version_warning)}", emoji=False, soft_wrap=True)
    console.print(f"layer {res.layer} of 0..{res.num_layers - 1}, {head_txt} ({res.num_heads} heads); top {top} "
                  f"links per target, normalised per target{', self-links excluded' if exclude_self else ''}",
                  markup=False, soft_wrap=True)
    console.print(_INSPECT_LEGEND.format(top=top, last=res.prompt_len - 1, first=res.prompt_len),
                  markup=False, highlight=False, soft_wrap=True)
    if target is None:
        for line in _inspect_summary(res, top, all_links):
            console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
    if target is not None or all_links:
        for line in res.lines:
            console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
    if plot is not None:
        title = f"{run_dir.name}: {tr.sample_id}, layer {res.layer}, {head_txt}"
        try:
            out = plot_attention(res.matrix, res.labels, res.prompt_len, plot, title=title)
        except (OSError, ValueError) as e:
            _fail(f"cannot write the heat map {plot}: {e}")
        console.print(f"heat map written to {out}", markup=False, soft_wrap=True)


@app.command("simulate")
def simulate_cmd(
    config: Annotated[Path, typer.Argument(help="simulator YAML/JSON config, or a run directory to calibrate from")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides, e.g. eta=4 rollout.workers=64")] = None,
    modes: Annotated[str, typer.Option(help="comma-separated modes to compare: sync, one_step, async (async uses eta)")] = "sync,one_step,async",
    sweep: Annotated[str | None, typer.Option(help="key=v1,v2,... : one row per value, e.g. proximal.devices=0,1,2,4")] = None,
    write_config: Annotated[Path | None, typer.Option("--write-config", help="save the (calibrated) config as YAML here")] = None,
    output: Annotated[Path | None, typer.Option(help="write all predictions as JSON here")] = None,
) -> None:
    """Predict throughput, idle fractions and staleness with a discrete-event model (simpy).

    CONFIG is a simulator config (see configs/simulate/) or a run directory written by
    `conveyor train`, from whose trace (engine decode profile, lengths, trainer times) the model
    is calibrated.
    """
    import yaml
    from rich.table import Table

    from conveyor.simulate import (
        SimConfig,
        apply_overrides,
        calibrate,
        load_sim_config,
        simulate,
        validate_sim_config,
    )

    try:
        if config.is_dir():
            notes: list[str] = []
            base = calibrate(config, notes)
            for note in notes:
                console.print(f"[bold yellow]note:[/] {note}", soft_wrap=True)
            if overrides:
                base = validate_sim_config(apply_overrides(base.model_dump(), overrides),
                                           " + ".join([f"calibrated from {config}", *overrides]))
        else:
            base = load_sim_config(config, overrides)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if write_config is not None:
        write_config.parent.mkdir(parents=True, exist_ok=True)
        write_config.write_text(yaml.safe_dump(base.model_dump(), sort_keys=False))
        console.print(f"config written to {write_config}")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for m in mode_list:
        if m not in ("sync", "one_step", "async"):
            _fail(f"--modes: unknown mode {m!r} (sync, one_step, async)")
    variants: list[tuple[str, SimConfig]] = []
    if sweep:
        if "=" not in sweep:
            _fail(f"--sweep {sweep!r}: expected key=v1,v2,...")
        key, vals = sweep.split("=", 1)
        for v in vals.split(","):
            data = base.model_dump()
            node = data
            parts = key.split(".")
            for k in parts[:-1]:
                node = node.get(k) if isinstance(node, dict) else None
                if node is None:
                    _fail(f"--sweep: no section {k!r} in the simulator config")
            if parts[-1] not in node:
                _fail(f"--sweep: no key {key!r} in the simulator config")
            node[parts[-1]] = yaml.safe_load(v)
            try:
                variants.append((f"{key}={v}", validate_sim_config(data, f"--sweep {key}={v}")))
            except ValueError as e:
                _fail(str(e))
    else:
        variants.append(("", base))
    table = Table(title="conveyor simulate")
    # piped or redirected, rich would wrap the table at 80 columns (squeezing every cell to
    # "one_…"): print it at its natural width unless COLUMNS says otherwise
    out = console if console.is_terminal or os.environ.get("COLUMNS") else Console(width=200)
    for col in ("variant", "mode", "eta", "wall s", "s/step", "vs sync", "T idle", "R idle", "stale", "traj/s"):
        table.add_column(col)
    results = []
    for label, cfg in variants:
        sync_wall = None
        for m in mode_list:
            c = cfg.model_copy(update={"mode": m})
            r = simulate(c).summary()
            if m == "sync":
                sync_wall = r["wall_seconds"]
            speed = f"{sync_wall / r['wall_seconds']:.2f}x" if sync_wall else "-"
            results.append({"variant": label, "mode": m, "eta": c.effective_eta,
                            "critic_warmup_steps": c.critic_warmup_steps, **r})
            table.add_row(label, m, str(c.effective_eta), f"{r['wall_seconds']:.1f}", f"{r['mean_step_seconds']:.2f}", speed,
                          f"{r['trainer_idle']:.2f}", f"{r['rollout_idle']:.2f}",
                          f"{r['staleness_mean']:.2f}/{r['staleness_max']}", f"{r['trajectories_per_s']:.2f}")
    out.print(table)
    out.print("T idle / R idle: trainer / rollout idle fractions (0-1); stale: staleness mean/max (versions); "
              "vs sync: speed-up over the sync row of the same variant", soft_wrap=True)
    warm = [r for r in results if r["warmup_seconds"] > 0]
    if warm:
        out.print(f"wall s includes the critic warm-up ({warm[0]['critic_warmup_steps']} critic-only steps first: "
                  f"{warm[0]['warmup_seconds']:.1f} s of the first such row); s/step is the policy updates'",
                  soft_wrap=True)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, indent=2))
        console.print(f"predictions written to {output}")


@app.command("serve")
def serve_cmd(
    model: Annotated[str, typer.Option(help="preset (smollm2-135m-instruct, tiny), HF directory, .gguf file, a run's "
                                            "export (RUN/export) or run directory (its export)")] = "smollm2-135m-instruct",
    host: Annotated[str, typer.Option(help="interface to bind (default: this machine only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 30000,
    api_key: Annotated[str | None, typer.Option(envvar="CONVEYOR_API_KEY", help="require 'Authorization: Bearer KEY' on every request (or set CONVEYOR_API_KEY)")] = None,
    max_batch_size: Annotated[int, typer.Option(help="engine decode batch (sequences)")] = 32,
    seed: Annotated[int, typer.Option(help="engine seed (requests without a seed)")] = 0,
    num_threads: Annotated[int | None, typer.Option(help="decode thread's intra-op threads (default: torch's)")] = None,
    device: Annotated[str, typer.Option(help="where the engine runs: auto (a GPU when one is seen), cpu, cuda, "
                                             "cuda:N")] = "auto",
    init: Annotated[str, typer.Option(help="pretrained (the model's weights) or random (its config.json's "
                                           "architecture with random weights: speed measurements)")] = "pretrained",
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Serve a model over HTTP with SGLang's native API (/generate, /update_weights_from_disk,
    /pause_generation, /continue_generation, /abort_request, /health, /get_model_info,
    /get_weight_version), /conveyor/stats, and a minimal imitation of vLLM's /v1/completions
    (token-id prompts). Clients: conveyor.rollout.engine.remote.HttpEngine / VllmCompletionsEngine.
    """
    from rich.markup import escape

    from conveyor.eval import resolve_eval_model
    from conveyor.models import ModelLoadError
    from conveyor.rollout.engine.server import serve

    try:  # a run directory serves its export, as conveyor eval evaluates it
        model, note = resolve_eval_model(model, verb="serving")
    except ValueError as e:
        _fail(str(e))
    if note is not None:
        console.print(f"[bold yellow]note:[/] {escape(note)}", emoji=False, soft_wrap=True)
    if not 0 < port < 65536:
        _fail(f"--port must be in 1..65535, got {port}")
    if max_batch_size < 1:
        _fail(f"--max-batch-size must be >= 1, got {max_batch_size}")
    engine_device = _engine_options(device, init)
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning:[/] serving on {host} without --api-key: anyone who can "
                      "reach the port can generate and replace the weights", soft_wrap=True)
    logging.basicConfig(level=logging.INFO)
    try:
        serve(model, host=host, port=port, api_key=api_key, max_batch_size=max_batch_size,
              seed=seed, num_threads=num_threads, log_level=log_level, device=engine_device, init=init)
    except (ModelLoadError, ValueError) as e:  # (ValueError: an export's unreadable conveyor.json)
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot serve on {host}:{port}: {e}")


if __name__ == "__main__":  # pragma: no cover
    app()
