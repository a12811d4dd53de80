"""Trainer: turns a batch of finished trajectories into a policy update.

Data flow inside this package (MISSION.md sections 1, 2, 5):
proximal log-probs (a forward pass before optimising) -> advantages -> loss -> optimiser step.

Modules:
    advantages: outcome-reward advantage estimators (GRPO, Dr. GRPO, REINFORCE with a batch-mean
        baseline) and their broadcast to response tokens. Pure tensor functions.
    losses: policy-gradient losses (PPO clip, decoupled PPO) and the KL penalty. Each loss is a
        pure function of ``[B, T]`` tensors returning a ``LossOutput`` of SUMS (loss, token
        count, metrics) so the trainer can normalise exactly by a global token count across
        micro-batches; ``losses.aggregate`` turns the sums into means for logging.
"""
