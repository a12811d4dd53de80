"""conveyor: asynchronous reinforcement-learning post-training of large language models.

Data flow (the folder layout follows it):
``data`` -> ``rollout`` (engine, workflow, controller) -> buffer -> ``trainer`` (proximal
log-probs, advantages, loss) -> weight sync -> engine. See ``../shared/spec/MISSION.md``.
"""

__version__ = "0.1.0"
