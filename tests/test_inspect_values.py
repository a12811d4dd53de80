"""``conveyor inspect RUN --values`` (issue 45 section 2): the critic's values along one held-out
response, end to end on 1-step tiny runs trained with a critic, checked against the values
computed directly from the checkpoint's critic (so a wrong alignment or loading fails)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conveyor.cli import app
from conveyor.inspect_attention import Policy, Trajectory, load_trajectory
from conveyor.inspect_values import (
    ValuesResult,
    format_values,
    inspect_values,
    response_values,
    value_moves,
)

BASE = [
    "model.name=tiny", "trainer.batch_size=2", "rollout.group_size=2", "rollout.max_new_tokens=10",
    "data.heldout_limit=2", "run.eval_max_new_tokens=12", "run.progress=false", "run.export=false",
    "reward.workers=1", "trainer.lr=1e-3", "rollout.tool=none", "trainer.total_steps=1", "loss.advantage=gae",
]
# one response-token line: k, V, change ('.' for k = 0), [std], [obs], 'token'
TOKEN_LINE = re.compile(r"^\s+(\d+)\s+([+-]\d+\.\d{4})\s+(\.|[+-]\d+\.\d{4})(?:\s+(\d+\.\d{4}))?(\s+obs)?\s+(['\"].*)$")


def _train(tmp_path_factory, name: str, extra: list[str]) -> Path:
    from conveyor.config import load_config
    from conveyor.train import run_training

    run = tmp_path_factory.mktemp(name) / "run"
    run_training(load_config(None, BASE + extra + [f"run.dir={run}"]))
    assert (run / "checkpoints" / "step_1" / "DONE").is_file() and (run / "eval_after.json").is_file()
    return run


@pytest.fixture(scope="module")
def gae_run(tmp_path_factory):
    """One critic with a backbone of its own (a copy of the policy), with an export beside the checkpoint."""
    return _train(tmp_path_factory, "values", ["run.export=true"])


@pytest.fixture(scope="module")
def ensemble_run(tmp_path_factory):
    """Two head critics (AsyPPO's ensemble on the policy's own hidden states)."""
    return _train(tmp_path_factory, "values_ens", ["critic.backbone=head", "critic.num_critics=2"])


def _rows(output: str) -> list[tuple[int, float, float | None, float | None, bool]]:
    rows = []
    for line in output.splitlines():
        m = TOKEN_LINE.match(line)
        if m:
            rows.append((int(m.group(1)), float(m.group(2)), None if m.group(3) == "." else float(m.group(3)),
                         None if m.group(4) is None else float(m.group(4)), m.group(5) is not None))
    return rows


def _direct(run: Path, sample: int):
    """Each critic's values computed here from the checkpoint, without conveyor.inspect_values:
    the policy's state onto tiny, each critic rebuilt and its saved state loaded, one forward
    pass over prompt + response; returns (values of every position [N, T], trajectory)."""
    from conveyor.models import load_model
    from conveyor.trainer.critic import build_value_model

    cfg = json.loads((run / "config.json").read_text())
    state = torch.load(run / "checkpoints" / "step_1" / "trainer.pt", map_location="cpu", weights_only=False)
    lm = load_model("tiny", seed=cfg["model"]["seed"])
    lm.model.load_state_dict(state["model"])
    traj = load_trajectory(run, lm.tokenizer, sample)
    out = []
    for i, st in enumerate([state["critic"], *state.get("critics_more", [])]):
        critic = build_value_model(lm.model, cfg["critic"]["backbone"], seed=i)
        critic.load_state_dict(st["model"])
        critic.eval()
        with torch.no_grad():
            out.append(critic(torch.tensor([traj.ids]))[0])
    return torch.stack(out), traj


@pytest.mark.parametrize("sample", [0, 1])
def test_values_are_the_checkpoint_critics_before_each_response_token(gae_run, sample):
    r = CliRunner().invoke(app, ["inspect", str(gae_run), "--values", "--sample", str(sample), "--top", "5"])
    assert r.exit_code == 0, r.output
    assert "--values ignores --top" in r.output
    # the export holds no critic: policy and critic come from the checkpoint, its step named
    assert "policy and critic: checkpoint step_1 (policy version 1) on tiny and its critic of the same step 1" in r.output
    assert "1 critic, critic.backbone=policy" in r.output
    assert f"record {sample} of {gae_run / 'eval_after.json'}" in r.output

    every, traj = _direct(gae_run, sample)
    p, n = len(traj.prompt_ids), len(traj.response_ids)
    expected = every[0, p - 1: p - 1 + n]  # the state before response token k: position P - 1 + k
    shifted = every[0, p: p + n]
    assert float((expected - shifted).abs().max()) > 1e-3  # the check below can tell an off-by-one

    rows = _rows(r.output)
    assert [k for k, *_ in rows] == list(range(n))
    shown = torch.tensor([v for _, v, *_ in rows])
    assert torch.allclose(shown, expected, atol=6e-5, rtol=0), (shown, expected)
    for k in range(1, n):  # the change from the previous token's value
        assert abs(rows[k][2] - (float(expected[k]) - float(expected[k - 1]))) <= 1.5e-4
    assert rows[0][2] is None and all(std is None and not obs for *_, std, obs in rows)

    res = inspect_values(gae_run, sample=sample)
    assert torch.allclose(res.values, expected, atol=1e-6, rtol=0) and res.std is None
    assert res.step == 1 and res.checkpoint.name == "step_1" and res.per_critic.shape == (1, n)
    assert bool(res.action_mask.all()) and (res.returns is None) == (traj.correct is None)

    # the summary: first and last values, the return, the largest moves with the tokens that made them
    assert f"value at the first token (k=0): {float(expected[0]):+.4f}" in r.output
    assert f"value at the last token (k={n - 1}): {float(expected[-1]):+.4f}" in r.output
    if traj.correct is not None:  # (no reward recorded: the verdict stands for it)
        g = 1.0 if traj.correct else 0.0
        assert f"return: {g:g}; error of the first value V - G = {float(expected[0]) - g:+.4f}" in r.output
    rises, falls = value_moves(expected)
    rise_line = next(line for line in r.output.splitlines() if "largest rises:" in line)
    for j, d in rises:
        assert f"token {j} " in rise_line and f"(V {j} -> {j + 1}) {d:+.4f}" in rise_line
    fall_line = next(line for line in r.output.splitlines() if "largest falls:" in line)
    for j, d in falls:
        assert f"(V {j} -> {j + 1}) {d:+.4f}" in fall_line


def test_an_ensemble_prints_the_mean_and_the_critics_spread(ensemble_run):
    r = CliRunner().invoke(app, ["inspect", str(ensemble_run), "--values"])
    assert r.exit_code == 0, r.output
    assert "2 critics (ensemble; the value is their mean" in r.output and "critic.backbone=head" in r.output
    every, traj = _direct(ensemble_run, 0)  # head critics on the checkpoint's policy
    p, n = len(traj.prompt_ids), len(traj.response_ids)
    each = every[:, p - 1: p - 1 + n]
    assert float((each[0] - each[1]).abs().max()) > 1e-3  # two different critics
    mean, std = each.mean(dim=0), each.std(dim=0, unbiased=False)
    rows = _rows(r.output)
    assert [k for k, *_ in rows] == list(range(n))
    assert torch.allclose(torch.tensor([v for _, v, *_ in rows]), mean, atol=6e-5, rtol=0)
    assert torch.allclose(torch.tensor([s for *_, s, _ in rows]), std, atol=6e-5, rtol=0)
    res = inspect_values(ensemble_run)
    assert torch.allclose(res.per_critic, each, atol=1e-6, rtol=0)
    assert torch.allclose(res.values, mean, atol=1e-6, rtol=0) and torch.allclose(res.std, std, atol=1e-6, rtol=0)


def _fails(run: Path) -> str:
    r = CliRunner().invoke(app, ["inspect", str(run), "--values"])
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), r.output  # an error line, no traceback
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.output
    return " ".join(r.output.split())


def test_a_run_without_a_critic_or_a_checkpoint_is_one_clear_error(gae_run, tmp_path):
    no_critic = tmp_path / "grpo"
    no_critic.mkdir()
    cfg = json.loads((gae_run / "config.json").read_text())
    cfg["loss"]["advantage"] = "grpo"
    (no_critic / "config.json").write_text(json.dumps(cfg))
    shutil.copy(gae_run / "eval_after.json", no_critic)
    out = _fails(no_critic)
    assert "trained without a critic (loss.advantage=grpo" in out and "needs a run trained with loss.advantage=gae" in out

    no_ckpt = tmp_path / "no_ckpt"
    shutil.copytree(gae_run, no_ckpt, ignore=shutil.ignore_patterns("checkpoints", "run.lock"))
    out = _fails(no_ckpt)
    assert "has no intact checkpoint" in out and "the export holds the policy alone" in out
    assert "run.final_checkpoint" in out and "run.checkpoint_every" in out


def test_response_values_alignment_on_a_counting_critic():
    class Position(torch.nn.Module):  # V(state read up to position t) = t
        config = type("C", (), {"max_position_embeddings": 16})()

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, ids):
            return torch.arange(ids.shape[1], dtype=torch.float32).unsqueeze(0) + self.w

    v = response_values([Position()], [5, 6, 7, 8, 9], prompt_len=3)
    assert v.tolist() == [[2.0, 3.0]]  # the states before response tokens 0 and 1: positions P-1, P


def test_format_values_marks_observations_and_names_the_moving_tokens(tmp_path):
    values = torch.tensor([0.1, 0.5, 0.4, 0.4, 0.9])
    traj = Trajectory([1, 2], [3, 4, 5, 6, 7], "s/1", tmp_path / "eval_after.json", 0, True, 3, exact_ids=True)
    mask = torch.tensor([True, True, False, False, True])
    res = ValuesResult(Policy(None, None, "checkpoint step_3 (policy version 3) on tiny", True, [], 3), traj,
                       tmp_path / "checkpoints" / "step_3", 3,
                       {"backbone": "policy", "gamma": 1.0, "value_bounds": [-1.0, 2.0], "values": "token"},
                       values.unsqueeze(0), values, None, mask, ["a", "b", "<obs>", "\n", "e"], 1.0,
                       "recorded by the evaluation", torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0]))
    out = "\n".join(format_values(res))
    rows = _rows(out)
    assert [obs for *_, obs in rows] == [False, False, True, True, False]
    assert rows[3][2] == 0.0 and rows[1][2] == pytest.approx(0.4)
    assert "'\\n'" in out  # repr-escaped
    assert "(s/1, correct)" in out and "critic.value_bounds [-1, 2]" in out
    assert "value at the last token (k=4): +0.9000" in out and "return: 1; error of the first value V - G = -0.9000" in out
    assert "largest rises: token 3 '\\n' (V 3 -> 4) +0.5000; token 0 'a' (V 0 -> 1) +0.4000" in out
    assert "largest falls: token 1 'b' (V 1 -> 2) -0.1000" in out
    assert value_moves(torch.tensor([1.0])) == ([], [])
