"""Attention inspection (``conveyor inspect``): which earlier tokens a response token attended to.

``docs/MISSION.md`` section 4 (AsyPPO's inspection): parse a response's attention matrix into
lines ``Step s: Token j -> Token i  w%``, the strongest links into a target token ``i``.

Conventions:

- An attention matrix ``A`` is ``[T, T]``: row ``i`` is the target (query) token, column ``j``
  the source (key) token; causal, so only ``j <= i`` carry weight. Token indices are positions
  in the whole sequence (prompt + response).
- Weights are normalised per target token: over the sources ``0..i`` of row ``i`` (without
  ``i`` itself under ``exclude_self``), so a target's listed weights sum to at most 100%.
  A model's row already sums to 1; renormalising matters for ``exclude_self``.
- Ties are broken by the lower source index; links of weight 0 are not listed (so fewer than
  ``k`` can come back). A target with no weight left (``exclude_self`` on token 0, or a row with
  all its weight on itself) has no links.
- No target given: every response token is a target, in order, each with its own top ``k``
  (steps numbered 1..k per target, a blank line between targets).
- Layer: default the last. Head: default the mean over the heads (each head's rows sum to 1, so
  the mean's do too).

The model side (:func:`inspect_run`): the run's policy (:func:`load_policy`: the export, else
the newest intact checkpoint, else the configured base model, said so), one held-out trajectory
(:func:`load_trajectory`: a record of the run's latest evaluation file, its prompt rebuilt with
the run's chat template and instruction, its response text re-encoded), and one forward pass
with ``output_attentions=True`` under transformers' ``eager`` attention, the only
implementation that returns the weights (:func:`attention_maps`).
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

EVAL_AFTER = "eval_after.json"
_EVAL_STEP_RE = re.compile(r"^eval_step_(\d+)\.json$")


class InspectError(ValueError):
    """Bad input to the inspection (the message names the value and what is valid)."""


@dataclass(frozen=True)
class Link:
    """One attention link ``source -> target``.

    Attributes:
        source: Source (key) token index j.
        target: Target (query) token index i (j <= i).
        weight: Share of the target's (normalised) attention, in [0, 1].
    """

    source: int
    target: int
    weight: float


def _as_matrix(attn) -> np.ndarray:
    if hasattr(attn, "detach"):  # a torch tensor
        attn = attn.detach().float().cpu().numpy()
    a = np.asarray(attn, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise InspectError(f"the attention matrix must be square [T, T], got shape {tuple(a.shape)}")
    return a


def _check_index(value: int, size: int, what: str, unit: str) -> None:
    if size < 1:
        raise InspectError(f"{what} {value}: there are no {unit}")
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value < size:
        raise InspectError(f"{what} {value} is out of range: there are {size} {unit} (0..{size - 1})")


def top_links(attn, target: int, k: int, exclude_self: bool = False) -> list[Link]:
    """The ``k`` strongest attention links into ``target``.

    Args:
        attn: Attention matrix ``[T, T]`` (numpy array, torch tensor or nested lists); row =
            target (query) token, column = source (key) token. Only the causal part of the row,
            sources ``0..target``, is read.
        target: Target token index i, ``0 <= i < T``.
        k: How many links at most (``>= 1``).
        exclude_self: Leave out the link ``i -> i`` and normalise over the other sources.

    Returns:
        Up to ``k`` :class:`Link` s, strongest first, ties by lower source index; weights are the
        row's (after the exclusion) divided by its sum, so they sum to <= 1. Sources of weight 0
        are not listed; an empty list when no weight is left (e.g. ``exclude_self`` and a row
        with all its weight on itself, or target 0).

    Raises:
        InspectError: ``attn`` not square, ``target`` out of range (the message gives the valid
            range), ``k < 1``, or a row weight negative or not finite.
    """
    a = _as_matrix(attn)
    _check_index(target, a.shape[0], "target token", "tokens")
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise InspectError(f"top k must be an integer >= 1, got {k!r}")
    target = int(target)
    row = a[target, : target + 1].copy()
    if not np.all(np.isfinite(row)) or np.any(row < 0):
        raise InspectError(f"row {target} of the attention matrix has a negative or non-finite weight")
    if exclude_self:
        row[target] = 0.0
    total = float(row.sum())
    if total <= 0.0:
        return []
    order = sorted((j for j in range(target + 1) if row[j] > 0.0), key=lambda j: (-row[j], j))
    return [Link(j, target, float(row[j] / total)) for j in order[:k]]


def _label(labels: Sequence[str] | None, index: int) -> str:
    if labels is None:
        return ""
    return " " + json.dumps(labels[index], ensure_ascii=False)


def format_links(links: Sequence[Link], labels: Sequence[str] | None = None) -> list[str]:
    """Console lines for one target's links: ``Step s: Token j -> Token i  w%``.

    ``s`` counts 1..len(links) in the given order, ``w`` is the weight in percent with 2
    decimals. With ``labels`` (one per token, e.g. the decoded token pieces), each index is
    followed by its label as a JSON string (newlines shown as ``\\n``):
    ``Step 1: Token 3 "Answer" -> Token 7 ":"  41.20%``.

    Args:
        links: From :func:`top_links`.
        labels: Optional token labels indexed by token position (length > every index used).

    Returns:
        One line per link (empty for no links).

    Raises:
        IndexError: a link's index has no label.
    """
    return [
        f"Step {s}: Token {ln.source}{_label(labels, ln.source)} -> "
        f"Token {ln.target}{_label(labels, ln.target)}  {100.0 * ln.weight:.2f}%"
        for s, ln in enumerate(links, start=1)
    ]


def select_attention(attentions: Sequence, layer: int | None = None, head: int | None = None):
    """One ``[T, T]`` matrix out of a model's per-layer attentions.

    Args:
        attentions: One tensor per layer, ``[1, H, T, T]`` or ``[H, T, T]`` (transformers'
            ``outputs.attentions``).
        layer: Layer index ``0..L-1``; None: the last.
        head: Head index ``0..H-1``; None: the mean over the heads.

    Returns:
        ``(matrix [T, T] as float64 numpy, layer used)``.

    Raises:
        InspectError: no attentions (the model did not return weights: not ``eager``), or
            ``layer`` / ``head`` out of range (the message names the value and the valid range).
    """
    if not attentions:
        raise InspectError("the model returned no attention weights (they need attn_implementation='eager')")
    n_layers = len(attentions)
    layer = n_layers - 1 if layer is None else layer
    _check_index(layer, n_layers, "layer", "layers")
    t = attentions[layer]
    if hasattr(t, "detach"):
        t = t.detach().float().cpu().numpy()
    t = np.asarray(t, dtype=np.float64)
    if t.ndim == 4:
        t = t[0]
    if head is None:
        return t.mean(axis=0), int(layer)
    _check_index(head, t.shape[0], "head", "heads")
    return t[head], int(layer)


# -- the run side ---------------------------------------------------------------------------


@dataclass
class Policy:
    """The loaded policy of a run.

    Attributes:
        model: A ``PreTrainedModel`` in eval mode. tokenizer: its tokenizer.
        source: What was loaded, in words (export, checkpoint, or the base model).
        trained: False when only the configured base model could be loaded.
        notes: Warnings (damaged checkpoints skipped, settings read leniently).
    """

    model: Any
    tokenizer: Any
    source: str
    trained: bool
    notes: list[str] = field(default_factory=list)


def run_settings(run_dir: str | Path) -> tuple[dict[str, Any], list[str]]:
    """The settings of a run that inspection needs, from its ``config.json``.

    Read with :func:`conveyor.train.load_run_config` (validated); a config an older or newer
    conveyor wrote that no longer validates is read as plain JSON instead, with a note.

    Returns:
        ``({"model": name, "model_seed": int, "heldout": spec or None, "split_seed": int,
        "instruction": str or None}, notes)``.

    Raises:
        FileNotFoundError: no ``config.json`` (not a run directory).
    """
    from conveyor.config import ConfigError
    from conveyor.train import load_run_config

    notes: list[str] = []
    try:
        cfg = load_run_config(run_dir)
        return {"model": cfg.model.name, "model_seed": cfg.model.seed, "heldout": cfg.data.heldout or None,
                "split_seed": cfg.data.split_seed, "instruction": cfg.data.instruction}, notes
    except ConfigError as e:
        notes.append(f"config.json does not validate with this conveyor ({e}); read as plain JSON")
    raw = json.loads((Path(run_dir) / "config.json").read_text())
    model, data = raw.get("model") or {}, raw.get("data") or {}
    return {"model": model.get("name", "smollm2-135m-instruct"), "model_seed": model.get("seed", 0),
            "heldout": data.get("heldout") or None, "split_seed": data.get("split_seed", 0),
            "instruction": data.get("instruction")}, notes


def _use_eager(model) -> None:
    """Switch to transformers' ``eager`` attention: ``sdpa`` (the default) and the flash kernels
    never materialise the softmax matrix, so with ``output_attentions=True`` they return no
    weights (transformers only warns); ``eager`` computes ``softmax(QK^T / sqrt(d))``
    explicitly and returns it. Slower, which only matters for this one forward pass."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:  # older transformers
        model.config._attn_implementation = "eager"


def load_policy(run_dir: str | Path, *, warn: Callable[[str], None] | None = None) -> Policy:
    """The run's policy, read-only (nothing in the run directory is changed):

    1. ``RUN/export`` (the final policy) when it holds a ``config.json``;
    2. else the newest committed checkpoint that passes
       :func:`conveyor.checkpoint.verify_checkpoint` (damaged ones are skipped with a note, not
       moved aside as a resume would): its ``trainer.pt`` model state loaded onto the run's
       ``model.name`` (``tiny``: same ``model.seed``; a LoRA run's adapter merged onto it);
    3. else the run's ``model.name`` as configured, untrained (``Policy.trained`` False).

    The model is switched to ``eager`` attention (:func:`_use_eager`) and put in eval mode.

    Args:
        run_dir: A ``conveyor train`` run directory.
        warn: Called with each note as well (they are also in ``Policy.notes``).

    Raises:
        FileNotFoundError: ``run_dir`` is not a run directory (no ``config.json``).
        conveyor.models.ModelLoadError: the model cannot be loaded.
        KeyError / RuntimeError: a checkpoint's model state does not fit the configured model.
    """
    import torch

    from conveyor.checkpoint import checkpoint_version, complete_checkpoints, verify_checkpoint
    from conveyor.models import load_model

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a conveyor run directory (no config.json)")
    settings, notes = run_settings(run_dir)
    export = run_dir / "export"
    if (export / "config.json").is_file():
        lm = load_model(str(export))
        policy = Policy(lm.model, lm.tokenizer, f"the run's export ({export})", True, notes)
    else:
        policy = None
        for ckpt in reversed(complete_checkpoints(run_dir)):
            reason = verify_checkpoint(ckpt)
            if reason is not None:
                notes.append(f"checkpoint {ckpt.name} skipped: {reason}")
                continue
            lm = load_model(settings["model"], seed=settings["model_seed"])
            state = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False, mmap=True)
            model_state = {k.removeprefix("_orig_mod."): v for k, v in state["model"].items()}
            model = lm.model
            if "lora" in state:  # a LoRA run's checkpoint holds the adapter: merged onto the base model
                from conveyor.trainer.lora import merged_from_checkpoint

                model = merged_from_checkpoint(lm.model, {**state, "model": model_state})
            else:
                model.load_state_dict(model_state)
            version = state.get("version", checkpoint_version(ckpt))
            del state, model_state
            policy = Policy(model, lm.tokenizer, f"checkpoint {ckpt.name} (policy version {version}) "
                            f"on {settings['model']}", True, notes)
            break
        if policy is None:
            lm = load_model(settings["model"], seed=settings["model_seed"])
            notes.append(f"{run_dir} has no export and no intact checkpoint: inspecting the base model "
                         f"{settings['model']} as configured (untrained), not the run's policy")
            policy = Policy(lm.model, lm.tokenizer, f"the base model {settings['model']} (untrained)", False, notes)
    _use_eager(policy.model)
    policy.model.eval()
    if warn is not None:
        for n in notes:
            warn(n)
    return policy


def latest_eval_file(run_dir: str | Path) -> Path:
    """The run's latest held-out evaluation file: ``eval_after.json``, else the ``eval_step_N.json``
    of the largest N, else ``eval_before.json``.

    Raises:
        FileNotFoundError: none of them exists (the message says which were looked for).
    """
    run_dir = Path(run_dir)
    if (run_dir / EVAL_AFTER).is_file():
        return run_dir / EVAL_AFTER
    steps = sorted(((int(m.group(1)), p) for p in run_dir.glob("eval_step_*.json")
                    if (m := _EVAL_STEP_RE.match(p.name))), reverse=True)
    if steps:
        return steps[0][1]
    if (run_dir / "eval_before.json").is_file():
        return run_dir / "eval_before.json"
    raise FileNotFoundError(f"{run_dir} has no held-out evaluation file ({EVAL_AFTER}, eval_step_N.json "
                            "or eval_before.json): nothing to inspect")


@dataclass
class Trajectory:
    """One held-out trajectory as token ids.

    Attributes:
        prompt_ids: The chat-formatted prompt (P tokens). response_ids: the response text
            re-encoded (R tokens; see :func:`load_trajectory`).
        sample_id: The data set sample's id. eval_file: the evaluation file it came from.
        index: Its record index there. correct: the evaluation's verdict (True / False / None).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    sample_id: str
    eval_file: Path
    index: int
    correct: bool | None = None

    @property
    def ids(self) -> list[int]:
        """Prompt and response ids, ``P + R`` tokens."""
        return self.prompt_ids + self.response_ids


def eval_record(run_dir: str | Path, sample: int = 0) -> tuple[Path, dict, dict]:
    """Record ``sample`` of the run's latest evaluation file (:func:`latest_eval_file`).

    Returns:
        ``(path, the file's JSON, the record)``; the record has a non-empty first response.

    Raises:
        FileNotFoundError: no evaluation file. InspectError: no records, ``sample`` out of range
        (the valid range named), or an empty first response.
    """
    path = latest_eval_file(run_dir)
    ev = json.loads(path.read_text())
    records = ev.get("records") or []
    if not records:
        raise InspectError(f"{path} has no records (written without per-problem details)")
    _check_index(sample, len(records), "--sample", f"records in {path.name}")
    rec = records[sample]
    responses = rec.get("responses") or []
    if not responses or not responses[0]:
        raise InspectError(f"record {sample} of {path.name} ({rec.get('id')}) has an empty response: nothing to inspect")
    return path, ev, rec


def load_trajectory(run_dir: str | Path, tokenizer, sample: int = 0) -> Trajectory:
    """Record ``sample`` of the run's latest evaluation file (:func:`latest_eval_file`), as ids.

    The prompt is rebuilt as the evaluation built it (:func:`conveyor.prompts.build_prompt_ids`:
    the tokenizer's chat template, the question of the data set sample with the record's id, and
    the evaluation's instruction, else the run's ``data.instruction``). The response is the
    record's first response text, encoded once without special tokens: the decoded text
    re-encoded, which can split differently from the generated ids (fine for inspection; with a
    tool, the inserted observations are part of that text).

    Args:
        run_dir: The run directory. tokenizer: the policy's tokenizer.
        sample: Record index, ``0 <= sample < number of records``.

    Raises:
        FileNotFoundError: no evaluation file. InspectError: ``sample`` out of range (valid range
        named), a record without responses or with an empty one, a sample id not in its data set.
        conveyor.data.DatasetError: the data set cannot be loaded.
    """
    from conveyor.data import load_dataset
    from conveyor.prompts import build_prompt_ids, resolve_instruction

    path, ev, rec = eval_record(run_dir, sample)
    responses = rec["responses"]
    settings, _ = run_settings(run_dir)
    dataset = ev.get("dataset") or settings["heldout"]
    split_seed = ev.get("split_seed")
    split_seed = settings["split_seed"] if split_seed is None else split_seed
    instruction = ev.get("instruction")
    if instruction is None:
        instruction = resolve_instruction(settings["instruction"], dataset)
    by_id = {s.id: s for s in load_dataset(dataset, split_seed=split_seed)}
    s = by_id.get(rec.get("id"))
    if s is None:
        raise InspectError(f"record {sample} of {path.name}: sample id {rec.get('id')!r} is not in {dataset} "
                           f"(split_seed {split_seed})")
    prompt = build_prompt_ids(tokenizer, s, instruction)
    response = list(tokenizer(responses[0], add_special_tokens=False)["input_ids"])
    if not response:
        raise InspectError(f"record {sample} of {path.name}: the response encodes to no tokens")
    correct = (rec.get("correct") or [None])[0]
    return Trajectory(prompt, response, s.id, path, sample, correct)


def attention_maps(model, ids: Sequence[int]) -> tuple:
    """One forward pass with ``output_attentions=True`` (no cache, no gradients).

    Args:
        model: A causal LM with ``eager`` attention (:func:`load_policy` sets it; otherwise it is
            set here, see :func:`_use_eager`).
        ids: Token ids, T tokens.

    Returns:
        One tensor per layer, ``[1, H, T, T]`` (rows sum to 1 over the causal sources).

    Raises:
        InspectError: ``T`` exceeds the model's context, or no weights came back.
    """
    import torch

    if getattr(model.config, "_attn_implementation", "eager") != "eager":
        _use_eager(model)
    n_ctx = getattr(model.config, "max_position_embeddings", None)
    if n_ctx is not None and len(ids) > n_ctx:
        raise InspectError(f"the trajectory has {len(ids)} tokens, more than the model's context ({n_ctx})")
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids)], device=device), output_attentions=True, use_cache=False)
    if not out.attentions:
        raise InspectError("the model returned no attention weights (they need attn_implementation='eager')")
    return out.attentions


@dataclass
class InspectResult:
    """What :func:`inspect_run` found.

    Attributes:
        lines: Console lines (:func:`format_links`, a blank line between targets).
        links: Per target index, its links (:func:`top_links`).
        matrix: The chosen ``[T, T]`` attention matrix (float64).
        labels: Decoded token pieces, one per token (T).
        prompt_len: P (the response is tokens ``P..T-1``).
        layer: Layer used. head: head used (None: mean over heads).
        num_layers, num_heads: The model's.
        policy: The :class:`Policy` (its source and notes). trajectory: the :class:`Trajectory`.
    """

    lines: list[str]
    links: dict[int, list[Link]]
    matrix: np.ndarray
    labels: list[str]
    prompt_len: int
    layer: int
    head: int | None
    num_layers: int
    num_heads: int
    policy: Policy
    trajectory: Trajectory


def inspect_run(run_dir: str | Path, *, sample: int = 0, layer: int | None = None, head: int | None = None,
                top: int = 3, target: int | None = None, exclude_self: bool = False,
                policy: Policy | None = None, warn: Callable[[str], None] | None = None) -> InspectResult:
    """Attention links of one held-out trajectory of a run under the run's policy.

    Args:
        run_dir: A ``conveyor train`` run directory (read only).
        sample: Record index in the latest evaluation file (:func:`load_trajectory`).
        layer: ``0..L-1``, None: the last. head: ``0..H-1``, None: the mean over heads.
        top: Links per target (``>= 1``).
        target: One target token index (a position in prompt + response, ``0..T-1``); None:
            every response token ``P..T-1``, each with its own top links.
        exclude_self: Leave out ``i -> i`` links (:func:`top_links`).
        policy: An already loaded :func:`load_policy` result (loaded here when None).
        warn: Passed to :func:`load_policy` (its notes).

    Returns:
        An :class:`InspectResult`.

    Raises:
        FileNotFoundError: not a run directory, or no evaluation file.
        InspectError: an argument out of range (named, with the valid range), see also
            :func:`load_trajectory` and :func:`load_policy`.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InspectError(f"--top must be an integer >= 1, got {top!r}")
    if not (Path(run_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a conveyor run directory (no config.json)")
    eval_record(run_dir, sample)  # a bad --sample fails before the model is loaded
    policy = policy or load_policy(run_dir, warn=warn)
    traj = load_trajectory(run_dir, policy.tokenizer, sample)
    ids = traj.ids
    attentions = attention_maps(policy.model, ids)
    matrix, layer = select_attention(attentions, layer, head)
    if target is not None:
        _check_index(target, len(ids), "--target", "tokens (prompt and response)")
    targets = [target] if target is not None else list(range(len(traj.prompt_ids), len(ids)))
    labels = [policy.tokenizer.decode([t]) for t in ids]
    lines: list[str] = []
    links: dict[int, list[Link]] = {}
    for i in targets:
        links[i] = top_links(matrix, i, top, exclude_self=exclude_self)
        if lines:
            lines.append("")
        lines.extend(format_links(links[i], labels) or [f"Token {i}{_label(labels, i)}: no links (no weight "
                                                         "outside itself)"])
    return InspectResult(lines, links, matrix, labels, len(traj.prompt_ids), layer, head, len(attentions),
                         int(attentions[0].shape[-3]), policy, traj)


def plot_attention(matrix, labels: Sequence[str], start: int, out: str | Path, *, title: str = "") -> Path:
    """Heat map of the response part of an attention matrix, saved as an image (matplotlib's Agg
    canvas; no global pyplot state).

    Rows are the targets ``start..T-1``, columns the sources ``start..T-1``, both labelled with
    their token pieces; the raw weights are shown (the part of each row on the prompt, columns
    ``0..start-1``, is not drawn: its mean share is given in the title).

    Args:
        matrix: ``[T, T]`` attention matrix. labels: T token labels.
        start: First response token P (``0 <= P < T``). out: image path (parents created).
        title: Title prefix.

    Returns:
        ``out`` as a Path.

    Raises:
        InspectError: shapes that do not fit (labels length, ``start`` out of range).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    a = _as_matrix(matrix)
    n = a.shape[0]
    if len(labels) != n:
        raise InspectError(f"{len(labels)} labels for a matrix of {n} tokens")
    _check_index(start, n, "start", "tokens")
    sub = a[start:, start:]
    prompt_share = float(a[start:, :start].sum(axis=1).mean()) if start > 0 else 0.0
    tick = [(lab.replace("\n", "\\n").replace("$", r"\$") or " ")[:14] for lab in labels[start:]]
    m = n - start
    size = min(40.0, max(6.5, 0.22 * m + 2.5))
    fig = Figure(figsize=(size + 1.2, size))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(sub, cmap="viridis", vmin=0.0, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    font = 8 if m <= 40 else 6
    ax.set_xticks(range(m))
    ax.set_xticklabels([f"{start + j} {t}" for j, t in enumerate(tick)], rotation=90, fontsize=font)
    ax.set_yticks(range(m))
    ax.set_yticklabels([f"{start + j} {t}" for j, t in enumerate(tick)], fontsize=font)
    ax.set_xlabel("source token j (key)")
    ax.set_ylabel("target token i (query)")
    note = (f"response tokens {start}..{n - 1}; the prompt's {start} tokens hold "
            f"{100 * prompt_share:.1f}% of a row's weight on average (not drawn)")
    width = int(size * 11)
    ax.set_title("\n".join(textwrap.fill(t, width) for t in (title, note) if t), fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
