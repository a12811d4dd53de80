"""Trainer processes for ``trainer.world_size`` > 1 (FSDP2 data parallelism on one machine).

The ``conveyor train`` process is rank 0: it runs the whole job as with one trainer (rollout,
rewards, logs, checkpoints, evaluations) and its :class:`~conveyor.trainer.trainer.Trainer`
announces each collective call (a train step, a weight gather, a checkpoint) to the other ranks
(:func:`conveyor.trainer.distributed.collective`). Ranks 1 .. W-1 are processes started here
(``multiprocessing`` spawn: fresh interpreters); each loads the same model, builds the same
trainer with its shard and repeats rank 0's calls (:func:`conveyor.trainer.distributed.follow`).
Nothing but trainer calls crosses between them: each call (with its batch) goes to every
follower through its own queue, so the waits between calls (rank 0 waiting for rollouts or
evaluating) are not collectives and have no timeout; the gathered weights stay at rank 0.

Failure: a follower that dies makes rank 0's next collective fail (gloo reports the lost peer;
a collective that waits longer than ``trainer.collective_timeout_s`` fails too), which stops the
run as any trainer error does (the last checkpoint is intact). A follower whose rank 0 is gone
(killed) exits within seconds. Closing the group stops the followers, waits for them briefly and
terminates what is left.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
from dataclasses import dataclass, replace

import torch

from conveyor.config import TrainConfig
from conveyor.trainer import distributed as dp_lib

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowerArgs:
    """What a follower process needs (picklable).

    Attributes:
        rank: 1 .. ``world_size - 1``. world_size: ``trainer.world_size``.
        port: Rank 0's rendezvous port on 127.0.0.1. backend: ``gloo`` / ``nccl``.
        config: The run's configuration (``TrainConfig.model_dump(mode="json", by_alias=True)``).
        bf16: rank 0's ``trainer.bf16`` choice (every process computes at the same precision).
        threads: Intra-op threads of this process.
        calls: The queue rank 0 announces calls on. leader_pid: rank 0's process id.
    """

    rank: int
    world_size: int
    port: int
    backend: str
    config: dict
    bf16: bool
    threads: int
    calls: object
    leader_pid: int


def _receiver(calls, leader_pid: int, poll_s: float = 2.0):
    """``receive()`` for :func:`conveyor.trainer.distributed.follow`: the next call from the
    queue; exits the process once rank 0 is gone (re-parented), never waits for ever."""
    def receive():
        while True:
            try:
                return calls.get(timeout=poll_s)
            except queue.Empty:
                if os.getppid() != leader_pid:
                    raise SystemExit(f"trainer follower {os.getpid()}: rank 0 ({leader_pid}) is gone") from None

    return receive


def follower_main(args: FollowerArgs) -> None:
    """A follower process: join the group, build the trainer with the same model and
    configuration as rank 0, repeat rank 0's calls until it stops the group."""
    from conveyor.models import load_model
    from conveyor.trainer.trainer import build_trainer

    # Ctrl-C / SIGTERM reach the whole process group: rank 0 handles them (a checkpoint after the
    # step, then closes the group); a follower that died on them would fail that checkpoint
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"[trainer rank {args.rank}] %(levelname)s %(name)s: %(message)s")
    cfg = TrainConfig.model_validate(args.config)
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.run.seed)
    dp = dp_lib.init_process_group(args.rank, args.world_size, port=args.port, backend=args.backend,
                                   timeout_s=cfg.trainer.collective_timeout_s)
    try:
        model = load_model(cfg.model.name, seed=cfg.model.seed, init=cfg.model.init).model
        trainer = build_trainer(cfg, model, bf16_choice=args.bf16, data_parallel=dp)
        dp_lib.follow(trainer, _receiver(args.calls, args.leader_pid))
    finally:
        torch.distributed.destroy_process_group()


class TrainerGroup:
    """Rank 0's handle on the follower processes (:meth:`start`, :meth:`close`).

    Attributes:
        dp: Rank 0's :class:`~conveyor.trainer.distributed.DataParallel`.
        processes: The followers (ranks 1 .. W-1).
    """

    def __init__(self, dp: dp_lib.DataParallel, processes: list, queues: list):
        self.processes = processes
        self._queues = queues
        self.dp = replace(dp, announce=self.announce)
        self._closed = False

    def announce(self, call: tuple) -> None:
        """Send ``(name, args, kwargs)`` to every follower (rank 0's side of
        :func:`conveyor.trainer.distributed.collective`)."""
        for q in self._queues:
            q.put(call)

    @classmethod
    def start(cls, cfg: TrainConfig, *, bf16: bool, threads: int, device: str = "cpu") -> TrainerGroup:
        """Start ranks 1 .. W-1 and join the group as rank 0 (waits until every follower has
        joined; they then load the model while rank 0 does).

        Args:
            cfg: The run's configuration (``trainer.world_size`` = W >= 2).
            bf16: The precision every process uses (rank 0's ``trainer.bf16`` choice).
            threads: Intra-op threads per follower.

        Raises:
            RuntimeError: the rendezvous failed (a follower could not start).
        """
        world = cfg.trainer.world_size
        port = dp_lib.free_port()
        backend = dp_lib.default_backend(device)
        spawn = mp.get_context("spawn")
        config = cfg.model_dump(mode="json", by_alias=True)
        procs, queues = [], []
        try:
            for rank in range(1, world):
                q = spawn.Queue()
                p = spawn.Process(target=follower_main, name=f"conveyor-trainer-{rank}", daemon=True,
                                  args=(FollowerArgs(rank, world, port, backend, config, bf16, threads, q, os.getpid()),))
                p.start()
                procs.append(p)
                queues.append(q)
            dp = dp_lib.init_process_group(0, world, port=port, backend=backend,
                                           timeout_s=cfg.trainer.collective_timeout_s)
        except BaseException:
            for p in procs:
                p.terminate()
                p.join(5.0)
            raise
        log.info("trainer: %d processes (FSDP2, %s), followers pids %s", world, backend, [p.pid for p in procs])
        return cls(dp, procs, queues)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the followers (announced, then joined; terminated after ``timeout_s``) and leave
        the process group. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        self.announce((dp_lib.STOP, (), {}))
        for p in self.processes:
            p.join(timeout_s)
            if p.is_alive():  # e.g. stuck in a collective rank 0 left
                log.warning("trainer group: follower %s did not stop in %.0f s; terminated", p.pid, timeout_s)
                p.terminate()
                p.join(5.0)
        for q in self._queues:
            q.close()
        try:
            torch.distributed.destroy_process_group()
        except Exception as e:
            log.warning("trainer group: %s", e)
