"""The runtime: what runs the step protocol (wait for a batch, train, publish weights, record)
around the engine, the rollout controller and the trainer. Issue 12 moves the inline runtime of
``conveyor.train`` here piece by piece; :mod:`conveyor.runtime.publish` is the publish phase."""
