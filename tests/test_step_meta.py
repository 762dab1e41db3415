"""The step's metadata (planning/step_meta.py): which steps may wait for loads in flight."""

from xinference.model.llm.vllm.xavier.planning.step_meta import EmptySteps, StepMeta


def test_only_an_empty_step_after_an_empty_step_is_idle():
    """A step vLLM scheduled no token for may wait (at most a few ms) for a load in flight
    only when the step before scheduled none either: the first empty step after a forward
    is launched before that forward's outputs are processed (async scheduling), which must
    not wait behind it."""
    steps = EmptySteps()
    scheduled = [5, 0, 0, 0, 3, 0, 1, 0, 0]
    assert [steps.idle(n) for n in scheduled] == [
        False, False, True, True, False, False, False, False, True]
    assert EmptySteps().idle(0) is False  # the first step of all: not known to follow one


def test_each_tensor_parallel_worker_sees_the_step_idle():
    assert StepMeta(idle=True).for_shard(1, 2).idle
    assert not StepMeta().for_shard(1, 2).idle
