"""`defective_unit`: a broken unit of one rank's matrix engine, as fleet studies find them (a
"mercurial core": one unit corrupts some of its operations, persistently, depending on the data).

From `fault.steps[0]` on, every matrix multiply the rank's forward makes (in the modules
`fault.tensor` names; every module by default) is struck with probability `rate`, drawn from the
trial's seed, the rank's machine, the step and the product's place in the step. A struck
product's outputs in the unit's lane, the columns j with j % `lanes` == `lane` of its last
dimension (a convolution's: its output channels), have one bit flipped: the unit's broken bit, a
bit of the class `fault.bit` names (`sign`, `exponent_msb`, `exponent`, `mantissa`; any bit when
null), drawn once per output dtype from the seed. A class, not an index: under autocast a
product's dtype is known only when it runs. The backward computes from the corrupted output as
it would from a genuine one.

Keys: `lane` (0..lanes-1), `lanes` (the engine's width in columns), `rate` (0 < rate <= 1). The
fault is permanent (the unit stays broken) at site matmul, forward, on one rank. Keys that would
be ignored are refused: those that pick elements or a product (`index`, `elements`, `select`,
`schedule`, `ber`, `product`, `nbits`, `adjacent`), another corruption (`factor`, `value`,
`stuck_at`), `probability` (`rate` draws the products) and `follows` (the unit is hardware).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from harness.core.settings import Settings
from harness.errors import ConfigError
from injectors import bits
from injectors.bitflip import choose_bit
from injectors.model import FaultModel

# Keys of every fault that a unit would ignore: they must keep their defaults.
IGNORED = ("index", "elements", "select", "schedule", "ber", "product", "nbits", "adjacent",
           "factor", "value", "stuck_at", "probability", "follows")  # fmt: skip


class DefectiveUnit(FaultModel):
    name = "defective_unit"
    per_product = True

    @dataclass(frozen=True)
    class Config(Settings):
        lane: int = 0
        lanes: int = 16
        rate: float = 0.01

        def __post_init__(self) -> None:
            for name in ("lane", "lanes"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(name, f"'{value}' must be an integer")
            if self.lanes < 1:
                raise ConfigError("lanes", f"{self.lanes}: a unit has 1 or more lanes")
            if not 0 <= self.lane < self.lanes:
                allowed = f"allowed: 0..{self.lanes - 1}"
                raise ConfigError("lane", f"{self.lane} is not allowed; {allowed}")
            rate = self.rate
            # NaN and infinity fail the range too.
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate <= 1:
                raise ConfigError("rate", f"'{rate}' must be a probability per product in (0, 1]")

    @classmethod
    def validate(cls, key: str, fault) -> None:
        if fault.site != "matmul":
            raise ConfigError(f"{key}.site", f"'{fault.site}': a defective unit computes "
                              "products; allowed: matmul")  # fmt: skip
        if fault.persistence != "permanent":
            message = "a defective unit stays broken (`rate` draws its products)"
            raise ConfigError(
                f"{key}.persistence", f"'{fault.persistence}': {message}; allowed: permanent"
            )
        if fault.phase != "forward":
            raise ConfigError(f"{key}.phase", "a defective unit corrupts products' outputs; "
                              "allowed: forward")  # fmt: skip
        unset = {f.name: f.default for f in dataclasses.fields(fault)}
        for name in IGNORED:
            if getattr(fault, name) != unset[name]:
                raise ConfigError(f"{key}.{name}", "a defective unit picks its own products and "
                                  "elements (lane, lanes, rate); leave it unset")  # fmt: skip
        if isinstance(fault.bit, int):
            raise ConfigError(f"{key}.bit", f"{fault.bit}: a unit's bit is a class, since a "
                              "product's dtype is known only when it runs; allowed: sign, "
                              "exponent_msb, exponent, mantissa, or null (any)")  # fmt: skip
        if len(fault.ranks) != 1:
            raise ConfigError(f"{key}.ranks", "a defective unit is on one rank's machine; "
                              "allowed: one rank")  # fmt: skip

    def __init__(self, fault, rng: random.Random):
        super().__init__(fault, rng)
        self.bits: dict[torch.dtype, int] = {}  # the broken bit, drawn once per output dtype

    def corrupt_lane(self, output: torch.Tensor, dim: int = -1) -> tuple[int, int]:
        """Flip the unit's bit in the lane's outputs (along `dim`) of one product in place; the
        bit's index and the elements flipped."""
        if output.dtype not in self.bits:
            self.bits[output.dtype] = choose_bit(self.fault, output.dtype, self.rng)
        bit = self.bits[output.dtype]
        settings = self.fault.settings
        index = [slice(None)] * output.dim()
        index[dim] = slice(settings.lane, None, settings.lanes)
        lane = output[tuple(index)]
        bits.flip_all(lane, bit)
        return bit, lane.numel()


MODEL = DefectiveUnit
