"""What the contribution models share: they act on one rank's contribution to a reduction."""

from __future__ import annotations

from harness.errors import ConfigError
from injectors.model import FaultModel


class ContributionModel(FaultModel):
    """A fault in what a rank sends into the reduction (`contribute`), not in a value it holds."""

    contribution = True

    @classmethod
    def validate(cls, key: str, fault) -> None:
        validate_reduction(key, fault, cls.name)


def validate_reduction(key: str, fault, name: str) -> None:
    if fault.site != "allreduce" or fault.scope != "reduction":
        raise ConfigError(
            f"{key}.model", f"'{name}' changes a contribution to the sum; it needs "
            "site allreduce and scope reduction"
        )  # fmt: skip
    if fault.tensor != "*" or fault.index is not None or fault.elements != 1:
        raise ConfigError(
            f"{key}.tensor", f"'{name}' takes the rank's whole contribution (every chunk, or "
            "the one fault.bucket names); leave tensor, index and elements unset"
        )  # fmt: skip
    if fault.schedule:
        raise ConfigError(
            f"{key}.schedule", f"'{name}' takes the rank's whole contribution, and a schedule's "
            "entries name elements; give the ranks and steps as fault.ranks and fault.steps"
        )  # fmt: skip
