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
    help="conveyor: asynchronous RL post-training of LLMs (train, eval, datasets).",
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
            progress=not no_progress and console.is_terminal,
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


if __name__ == "__main__":  # pragma: no cover
    app()
