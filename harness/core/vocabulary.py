"""The closed vocabularies that a config names, a rank acts on and trials.csv records: where a
fault strikes, how long it lasts, which ranks it reaches, how the model is sharded, and what it
did to the run (docs/design.md, sections 3-5). Each is defined here once; config validation,
the injectors, the judgement and the analysis take their values from these enums.

They are `StrEnum`s: a member is its value as a string, so a member compares equal to the text
a config or an older table holds, and formats as that text.
"""

from __future__ import annotations

from enum import StrEnum


class Site(StrEnum):
    """Where in the step a fault strikes; `none` is a clean trial."""

    NONE = "none"
    GRAD = "grad"
    ALLREDUCE = "allreduce"
    WEIGHT = "weight"
    OPTIMIZER = "optimizer"
    ACTIVATION = "activation"
    LOSS = "loss"
    MATMUL = "matmul"
    # Sharded training's all-gather (topology.parallel=fsdp|hsdp): a site a replicated step has not.
    GATHER = "gather"


# The sites every parallelism has, in the order configs and errors list them.
STEP_SITES = (
    Site.GRAD,
    Site.ALLREDUCE,
    Site.WEIGHT,
    Site.OPTIMIZER,
    Site.ACTIVATION,
    Site.LOSS,
    Site.MATMUL,
)
# Faults that enter the gradient of their own step: containing one means alerting before that
# step's optimizer update.
GRADIENT_SITES = frozenset(
    {Site.GRAD, Site.ALLREDUCE, Site.ACTIVATION, Site.LOSS, Site.MATMUL, Site.GATHER}
)
# The sites whose targets are modules: what a forward runs decides what they can strike.
MODULE_SITES = (Site.ACTIVATION, Site.MATMUL)


class Persistence(StrEnum):
    TRANSIENT = "transient"
    INTERMITTENT = "intermittent"
    PERMANENT = "permanent"


class Scope(StrEnum):
    """An allreduce fault's reach: one rank's contribution, or the reduction's result."""

    RANK = "rank"
    REDUCTION = "reduction"


class Parallel(StrEnum):
    """How the model is laid over the ranks: replicated, sharded, or sharded within replicas."""

    DDP = "ddp"
    FSDP = "fsdp"
    HSDP = "hsdp"


class Effect(StrEnum):
    """What a fault did to the run (docs/design.md, section 5)."""

    NONE = "none"  # a clean trial, or a planned fault that never struck
    MASKED = "masked"  # bit-identical to the golden run, no damaged state
    BENIGN = "benign"  # final loss within the noise band, nothing else wrong
    LATENT = "latent"  # loss within the band, but replicas apart or non-finite state
    HARMFUL = "harmful"  # final loss outside the band, or not a number
    CRASH = "crash"


# The effects that count as damage: the loss shows it, or the state holds it.
DAMAGING = (Effect.HARMFUL, Effect.LATENT)


class EffectSource(StrEnum):
    """Which run a trial's effect was judged on: the trial itself, or its observe twin when a
    check stopped the trial (the effect describes the fault, not the stop)."""

    RUN = "run"
    OBSERVE_TWIN = "observe twin"
