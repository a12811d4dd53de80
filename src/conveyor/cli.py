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
    help="conveyor: asynchronous RL post-training of LLMs (train, eval, datasets, report, simulate).",
)
console = Console()


def _slug(text: str) -> str:
    """A file-name-safe version of a model / dataset reference."""
    import re

    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text.strip("/")).strip("_")[:120] or "x"


def _fail(msg: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


@app.command("eval")
def eval_cmd(
    model: Annotated[str, typer.Option(help="preset (smollm2-135m-instruct, tiny), HF directory or .gguf file")] = "smollm2-135m-instruct",
    dataset: Annotated[str, typer.Option(help="dataset spec, e.g. mawps:singleop, gsm8k:test, svamp, rg:basic_arithmetic")] = "mawps:singleop",
    n: Annotated[int | None, typer.Option("--n", help="evaluate the first N problems (default: all)")] = None,
    k: Annotated[int, typer.Option("--k", help="k of pass@k")] = 1,
    samples: Annotated[int | None, typer.Option(help="samples per problem (>= k, default k)")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(help="tokens")] = 128,
    instruction: Annotated[str, typer.Option(help="appended to every question")] = "Give the final answer as a number after 'Answer:'.",
    split_seed: Annotated[int, typer.Option()] = 0,
    batch_size: Annotated[int, typer.Option(help="engine decode batch (sequences)")] = 32,
    seed: Annotated[int, typer.Option()] = 0,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="JSON output path")] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress")] = False,
    tool: Annotated[str, typer.Option(help="none, or calculator: results of 'a op b =' are inserted (rollout.tool)")] = "none",
) -> None:
    """Evaluate a model: pass@1, pass@k (Chen et al. 2021), avg@k, format rate, length, tokens/s."""
    from conveyor.data import DatasetError, load_dataset
    from conveyor.eval import evaluate
    from conveyor.models import ModelLoadError, load_model
    from conveyor.rollout.engine import InferenceEngine, SamplingParams

    if k < 1 or (samples is not None and samples < k):
        _fail(f"need 1 <= --k <= --samples; got --k {k}, --samples {samples}")
    if batch_size < 1:
        _fail(f"--batch-size must be >= 1, got {batch_size}")
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
        lm = load_model(model)
    except ModelLoadError as e:
        _fail(str(e))
    console.print(f"model {model} loaded in {lm.load_seconds:.1f} s; {len(data)} problems of {dataset}")
    engine = InferenceEngine(lm.model, lm.tokenizer, max_batch_size=batch_size, seed=seed)
    engine.start()
    try:
        res = evaluate(
            engine, lm.tokenizer, data, k=k, samples_per_problem=samples, temperature=temperature, top_p=top_p,
            max_new_tokens=max_new_tokens, instruction=instruction, dataset=dataset, model_name=model,
            progress=not no_progress and console.is_terminal, tool=tool,
        )
    except ValueError as e:
        _fail(str(e))
    finally:
        engine.stop()
    out = output or Path("runs") / "eval" / f"{_slug(model)}__{_slug(dataset)}.json"
    res.write_json(out)
    summ = res.summary()
    console.print_json(json.dumps(summ))
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
    from conveyor.train import load_run_config, run_training
    from conveyor.trainer.trainer import NonFiniteLossError

    ov = list(overrides or [])
    if config is not None and "=" in str(config):  # `conveyor train key=value` without a file
        ov.insert(0, str(config))
        config = None
    if resume and config is not None:
        _fail(f"--resume uses the run's saved config; pass changes as key=value overrides, not a file ({config})")
    try:
        cfg = load_run_config(resume, ov) if resume else load_config(config, ov)
    except (ConfigError, FileNotFoundError) as e:
        _fail(str(e))
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        handlers=[logging.FileHandler("/dev/null")] if quiet else None)
    try:
        res = run_training(cfg, resume_dir=resume, console=console)
    except (FileExistsError, FileNotFoundError, ModelLoadError, DatasetError, ConfigError) as e:
        _fail(str(e))
    except NonFiniteLossError as e:
        _fail(f"{e}\nThe last state was checkpointed; see events.jsonl in the run directory.", code=1)
    except (ValueError, ImportError, AttributeError, TypeError) as e:
        if "reward" in str(e) or "--resume" in str(e):  # bad reward.fn path, incompatible resume
            _fail(str(e))
        raise
    console.print(f"[bold]run directory:[/] {res.run_dir}  (steps {res.steps}, {res.wall_seconds:.0f} s, "
                  f"trainer busy {res.trainer_busy:.2f}, engine busy {res.engine_busy:.2f})")
    if res.heldout_before is not None or res.heldout_after is not None:
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        console.print(f"[bold]held-out pass@1 (greedy):[/] before {fmt(res.heldout_before)} -> after {fmt(res.heldout_after)}")
    if res.interrupted:
        console.print(f"stopped early; continue with: conveyor train --resume {res.run_dir}")
        sys.exit(130)


@app.command("datasets")
def datasets_cmd() -> None:
    """List the built-in dataset specs."""
    from conveyor.data import list_datasets

    for name in list_datasets():
        console.print(name)
    console.print("rg:<task>?size=N&seed=S  (any reasoning-gym task), file:/path.jsonl?question=..&answer=..")


@app.command("report")
def report_cmd(run_dir: Path) -> None:
    """Redraw the report PNG of a run directory."""
    from conveyor.runlog import plot_report

    console.print(str(plot_report(run_dir)))


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

    from conveyor.simulate import SimConfig, apply_overrides, calibrate, load_sim_config, simulate

    try:
        if config.is_dir():
            base = calibrate(config)
            if overrides:
                base = SimConfig.model_validate(apply_overrides(base.model_dump(), overrides))
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
                variants.append((f"{key}={v}", SimConfig.model_validate(data)))
            except ValueError as e:
                _fail(f"--sweep {key}={v}: {e}")
    else:
        variants.append(("", base))
    table = Table(title="conveyor simulate")
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
            results.append({"variant": label, "mode": m, "eta": c.effective_eta, **r})
            table.add_row(label, m, str(c.effective_eta), f"{r['wall_seconds']:.1f}", f"{r['mean_step_seconds']:.2f}", speed,
                          f"{r['trainer_idle']:.2f}", f"{r['rollout_idle']:.2f}",
                          f"{r['staleness_mean']:.2f}/{r['staleness_max']}", f"{r['trajectories_per_s']:.2f}")
    console.print(table)
    console.print("T idle / R idle: trainer / rollout idle fractions; stale: staleness mean/max (versions); "
                  "vs sync: speed-up over the sync row of the same variant")
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, indent=2))
        console.print(f"predictions written to {output}")


if __name__ == "__main__":  # pragma: no cover
    app()
