"""The training planner's library: will a configuration fit on a GPU, and how fast will it go, before a job
is submitted (the program is ``python -m slurmvla.plan``; docs/plan.md says what is counted, measured and
estimated, and how well).

``model_states``: the policy counted on the meta device, turned into bytes per GPU by the engine's own memory
rule (``EngineEntry.memory_rule``), so that any registered engine is planned without the planner knowing it.
``activations``: one training forward + backward on fake tensors (``autocast``: CUDA's autocast reproduced on
CPU tensors). ``step_time``: FLOPs and the step-time estimate. ``fit``: the figures of one engine on a world of
GPUs (``gpus``: the GPUs known). ``report``: the tables.
"""


class PlanError(ValueError):
    """A user's mistake in the plan's own arguments: one line, exit 2."""
