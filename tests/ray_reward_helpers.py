"""Reward functions for tests/test_ray_runtime.py.

A reward module the driver can import but the rollout actor cannot, like one installed on the
driver's machine but not on the cluster's nodes: the Ray runtime must report the actor's error in
the driver. A Ray worker does not get the test's ``sys.path`` (pytest puts ``tests/`` there), so
the actor does not find this module; should a Ray version hand the path over, importing it in a
worker raises. In any other process it imports and :func:`score` is a plain reward.
"""

from __future__ import annotations

import ray

if ray.is_initialized() and ray._private.worker.global_worker.mode == ray.WORKER_MODE:
    raise ImportError("ray_reward_helpers is not installed on this Ray node (simulated)")


def score(response: str, sample) -> float:
    """Response length in characters / 100 (a dense reward).

    Args:
        response: The response text. sample: Its data-set sample (unused).

    Returns:
        ``len(response) / 100``.
    """
    return len(response) / 100
