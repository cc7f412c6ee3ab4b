"""The tensors a checked fault names, against the workload's model: they exist at the fault's
site, a module site's targets run in the forward (and make the product a matmul fault picks),
and, sharded, the fault's rank holds an element of them. Checked once the fault's own keys are
(harness/config/faults.py) and the model is built (harness/config/workload.py's probe).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

import detectors
from harness.config.schema import FaultConfig
from harness.core.formats import FLOAT_FORMATS, unchanging_scale
from harness.core.matmuls import ForwardModules
from harness.core.plugins import matches
from harness.errors import ConfigError
from harness.runtime.comm import fixed_layout
from injectors import bits, sites
from injectors.value import unstored

# What a module site's targets are, for the error that names none matched.
SITE_TARGETS = {
    "activation": " (modules whose forward runs and returns a floating-point tensor)",
    "matmul": " (modules in whose forward a matrix multiply runs)",
    **dict.fromkeys(
        sites.TRAINED_ONLY, " (trainable parameters: a frozen one gets no gradient, sum or moment)"
    ),
}


def check_target(
    key: str,
    fault: FaultConfig,
    model: torch.nn.Module,
    forward: ForwardModules | None = None,
    shard_group: int | None = None,
    layout: list[tuple[str, ...]] | None = None,
    riders: int | None = None,
) -> None:
    """The tensors a fault names must exist at its site on this workload's model; at a module
    site, among the modules `forward` says the forward runs (one that never runs, such as a
    container, could never strike). Sharded over groups of `shard_group` ranks, a fault in a
    rank's own shard (sites allreduce, weight, optimizer) must find an element there. With
    the reduction's chunks known (`layout`, a campaign's fixed one: check_bucket has checked
    `fault.bucket` against it), a fault in one bucket names, counts and indexes only what that
    bucket holds; `riders`: the rider region's slots (the fewest the run may have), where known."""
    if fault.clean:
        return
    reachable = dict(sites.targets(fault.site, model, forward))
    held = None if layout is None or fault.bucket is None else layout[fault.bucket]
    if held is not None:
        reachable = {n: size for n, size in reachable.items() if n in held}
    names = ", ".join(reachable)
    where = f"site {fault.site}" if held is None else f"bucket {fault.bucket}"
    for i, entry in enumerate(fault.schedule):
        at = f"{key}.schedule[{i}]"
        if entry["tensor"] not in reachable:
            message = f"'{entry['tensor']}' is not in {where}; allowed: {names}"
            if held is None:
                message = f"'{entry['tensor']}' is not at site {fault.site}; allowed: {names}"
            raise ConfigError(f"{at}.tensor", message)
        size = reachable[entry["tensor"]]
        if size is not None and entry["index"] >= size:
            message = f"{entry['index']} is out of range; allowed: 0..{size - 1}"
            raise ConfigError(f"{at}.index", message)
    if fault.site == "loss" and forward is not None:
        _values_in(key, fault, [("loss", dtype) for dtype in forward.loss])
    if fault.schedule:
        if fault.site in sites.MODULE_SITES and forward is not None:
            named = [entry["tensor"] for entry in fault.schedule]
            if fault.site == "matmul":
                _reaches_product(key, fault, named, forward)
                if fault.phase == "backward":
                    _backward_reaches(key, fault, named, forward)
            for i, entry in enumerate(fault.schedule):
                at = f"{key}.schedule[{i}]"
                _within(f"{at}.index", fault, entry["tensor"], entry["index"], forward)
                if entry.get("bit") is not None:
                    struck = list(_struck_dtypes(fault, [entry["tensor"]], forward))
                    _bit_in_struck_dtype(f"{at}.bit", entry["bit"], struck)
            _written_in_struck_dtypes(key, fault, list(_struck_dtypes(fault, named, forward)))
        if shard_group is not None and fault.site in sites.SHARD_HELD:
            for i, entry in enumerate(fault.schedule):
                _in_shard(f"{key}.schedule[{i}]", fault, model, entry, shard_group)
        return
    matched = sites.matching(fault, model, forward)
    if held is not None and fault.tensor != sites.RIDERS:
        matched = [(n, size) for n, size in matched if n in held]
    if riders is not None and fault.tensor == sites.RIDERS:
        matched = [(sites.RIDERS, riders)]
    if not matched:
        where = SITE_TARGETS.get(fault.site, "")
        message = f"'{fault.tensor}' matches nothing at site {fault.site}{where}; allowed: {names}"
        raise ConfigError(f"{key}.tensor", message)
    if fault.site == "matmul" and forward is not None:
        _reaches_product(key, fault, [name for name, _ in matched], forward)
        if fault.phase == "backward":
            _backward_reaches(key, fault, [name for name, _ in matched], forward)
    if fault.site in sites.MODULE_SITES and forward is not None:
        targets = [name for name, _ in matched]
        if fault.index is not None:  # a grouped model's first element (past the end: clamped)
            for name in targets:
                _within(f"{key}.index", fault, name, fault.index, forward)
                if fault.model == "burst":
                    what, size = _struck_size(fault, name, forward)
                    _burst_fits(key, fault, fault.index, f"the {what} struck in '{name}'", size)
        if fault.model == "defective_unit":
            _lane_in_a_product(key, fault, targets, forward)
        elif fault.ber is None:
            _elements_in_module(key, fault, targets, forward)
        struck = list(_struck_dtypes(fault, targets, forward))
        if isinstance(fault.bit, int):
            _bit_in_struck_dtype(f"{key}.bit", fault.bit, struck)
        _written_in_struck_dtypes(key, fault, struck)
    if shard_group is not None and fault.site in sites.SHARD_HELD and fault.tensor != sites.RIDERS:
        sizes = _held(key, fault, model, [name for name, _ in matched], shard_group)
    else:
        sizes = [size for _, size in matched]
    if fault.index is not None and None not in sizes and fault.index + fault.elements > sum(sizes):
        high = sum(sizes) - fault.elements
        held_by = _held_by(fault, held)
        raise ConfigError(
            f"{key}.index", f"{fault.index} is out of range of the {sum(sizes)} elements "
            f"{held_by}; allowed: 0..{high}"
        )  # fmt: skip
    if fault.model == "burst" and fault.index is not None and held is None and shard_group is None:
        _burst_from_index(key, fault, matched)
    if None not in sizes and fault.ber is None:
        _elements_fit(key, fault, sizes, _held_by(fault, held))
        whole = shard_group is None and fault.tensor != sites.RIDERS
        if whole and fault.site not in sites.MODULE_SITES:
            _largest_picks(key, fault, sum(sizes), _held_by(fault, held))


def _burst_from_index(key: str, fault: FaultConfig, matched: list[tuple[str, int | None]]) -> None:
    """A burst from `fault.index`, counted over the named tensors in model order as the
    injector counts it, within the tensor that holds that element."""
    k = fault.index
    for name, size in matched:
        if size is None:
            return
        if k < size:
            _burst_fits(key, fault, k, f"'{name}'", size, fault.index - k)
            return
        k -= size


def _burst_fits(
    key: str, fault: FaultConfig, start: int, where: str, size: int, offset: int = 0
) -> None:
    """A burst starting at element `start` of what it strikes (`size` elements, 0: not traced;
    `offset`: its first element's place in fault.index's count) must end within it: one past
    the end was moved back to fit (burst.py), so it struck elements other than those named."""
    span = (fault.elements - 1) * fault.stride + 1
    if not size or start + span <= size:
        return
    allowed = (
        f"{offset}..{offset + size - span}" if size >= span
        else f"an element of a tensor of {span} or more"
    )  # fmt: skip
    raise ConfigError(
        f"{key}.index", f"{fault.index}: a burst of {fault.elements} at stride {fault.stride} "
        f"spans {span} elements, and from element {start} of {where} ({size} elements) it runs "
        f"past the end, so it would be moved back to start at {max(0, size - span)}; allowed: "
        f"{allowed}"
    )  # fmt: skip


def _held_by(fault: FaultConfig, held: tuple[str, ...] | None) -> str:
    """What holds a fault's elements, as its errors say it."""
    if fault.tensor == sites.RIDERS:
        return "the rider region holds"
    where = f"at site {fault.site}" if held is None else f"in bucket {fault.bucket}"
    return f"'{fault.tensor}' names {where}"


def _largest_picks(key: str, fault: FaultConfig, total: int, held_by: str) -> None:
    """`largest` among exactly `elements` elements (the loss's one) takes every one, as a random
    draw does: the strikes were the same, while the trial id and fault_settings told the two
    apart. (A module site strikes one of its modules' outputs, whose sizes may differ by run.)"""
    if fault.select == "largest" and fault.elements == total:
        fewer = f", or fault.elements below {total}" if total > 1 else ""
        raise ConfigError(
            f"{key}.select", f"largest: fault.elements={fault.elements} takes every element "
            f"{held_by}, as a random draw does; allowed: random{fewer}"
        )  # fmt: skip


def _elements_fit(key: str, fault: FaultConfig, sizes: list[int], held_by: str) -> None:
    """The elements a fault strikes within what it names: a draw past them took fewer (the
    loss's one element for 8), and a burst past the largest tensor was cut, while the record
    said what was asked."""
    if fault.model == "burst":
        span, largest = (fault.elements - 1) * fault.stride + 1, max(sizes)
        if span > largest:
            raise ConfigError(
                f"{key}.elements", f"a burst of {fault.elements} at stride {fault.stride} spans "
                f"{span} elements, past the largest tensor {held_by} ({largest} elements); "
                f"allowed: a span of at most {largest}"
            )  # fmt: skip
    elif fault.elements > sum(sizes):
        raise ConfigError(
            f"{key}.elements", f"{fault.elements} is more than the {sum(sizes)} elements "
            f"{held_by}; allowed: 1..{sum(sizes)}"
        )  # fmt: skip


def check_moments(key: str, optimizer: torch.optim.Optimizer, named: str) -> None:
    """Site optimizer strikes Adam's moments: an optimizer that keeps none once it has
    stepped (plain SGD) would never be struck. `named`: the optimizer, as the error says it."""
    if not any(set(sites.MOMENTS) <= set(state) for state in optimizer.state.values()):
        raise ConfigError(
            f"{key}.site", f"optimizer strikes Adam's moments ({', '.join(sites.MOMENTS)}), and "
            f"{named} keeps none: the fault could never strike; allowed: another site, or an "
            "Adam-family optimizer"
        )  # fmt: skip


def check_riders(key: str, fault: FaultConfig, checks: Iterable[str]) -> None:
    """A fault in the rider region needs a check that rides on the reduction: without one the
    region holds only the zeros of its slots, which a scale or a bit flip leaves as they were."""
    if fault.site != "allreduce" or fault.tensor != sites.RIDERS:
        return
    riding = sorted(n for n in detectors.available() if detectors.detector_class(n).rides())
    if not set(checks) & set(riding):
        raise ConfigError(
            f"{key}.tensor", f"{sites.RIDERS}: no check beside it rides on the reduction, so "
            "its rider region holds only zeros and the fault could never strike; run one of "
            f"{', '.join(riding)}, or name gradients"
        )  # fmt: skip


def check_bucket(key: str, fault: FaultConfig, model: torch.nn.Module) -> None:
    """A campaign's reduction chunks are fixed for the run's life (harness/runtime/comm.py): a
    bucket past the last is never reduced, so its fault could never strike. (A guard's buckets
    are its DDP module's own, known only once it has reduced.) What the fault names is then
    counted within that bucket (check_target)."""
    if fault.bucket is None:
        return
    layout = fixed_layout(model)
    count = len(layout)
    if fault.bucket >= count:
        raise ConfigError(
            f"{key}.bucket", f"{fault.bucket} is out of range: this model's gradients reduce in "
            f"{count} bucket{'s' * (count != 1)}; allowed: 0..{count - 1}"
        )  # fmt: skip
    held = layout[fault.bucket]
    # Every chunk carries the rider region where a check rides (check_riders), each its own.
    if fault.tensor == sites.RIDERS:
        return
    if not any(matches(name, fault.tensor) for name in held):
        raise ConfigError(
            f"{key}.tensor", f"'{fault.tensor}' matches nothing in bucket {fault.bucket}; "
            f"allowed: {', '.join(held)}"
        )  # fmt: skip


def _struck_size(fault: FaultConfig, name: str, forward: ForwardModules) -> tuple[str, int]:
    """What a module fault strikes in module `name`, and its elements as traced (0: not traced,
    an operand passed by keyword): its output (activation), or its product's output or, in
    backward, the second operand's gradient (matmul)."""
    if fault.site == "activation":
        return "output", forward.output_sizes.get(name, 0)
    backward = fault.phase == "backward"
    traced = forward.product(name, fault.product)
    if backward:
        return "product's second operand", traced.operand_size
    return "product", traced.size


def _elements_in_module(
    key: str, fault: FaultConfig, targets: list[str], forward: ForwardModules
) -> None:
    """A module fault strikes one module, drawn from those named: its `elements` (a burst's
    span) within what it strikes in each. A draw past them took fewer, while the record said
    what was asked."""
    span = (fault.elements - 1) * fault.stride + 1 if fault.model == "burst" else fault.elements
    for name in targets:
        what, size = _struck_size(fault, name, forward)
        if not size or span <= size:
            continue
        if fault.model == "burst":
            raise ConfigError(
                f"{key}.elements", f"a burst of {fault.elements} at stride {fault.stride} spans "
                f"{span} elements, past the {what} struck in '{name}' ({size} elements); "
                f"allowed: a span of at most {size}"
            )  # fmt: skip
        raise ConfigError(
            f"{key}.elements", f"{fault.elements} is more than the {size} elements of the "
            f"{what} struck in '{name}'; allowed: 1..{size}"
        )  # fmt: skip


def _within(key: str, fault: FaultConfig, name: str, index: int, forward: ForwardModules) -> None:
    """A schedule's element `index` within what it strikes in module `name`. Past it, the rank
    raised IndexError, recorded as a crash."""
    what, size = _struck_size(fault, name, forward)
    if size and index >= size:
        raise ConfigError(
            key, f"{index} is out of range: the {what} struck in '{name}' has {size} elements; "
            f"allowed: 0..{size - 1}"
        )  # fmt: skip


def _lane_in_a_product(
    key: str, fault: FaultConfig, targets: list[str], forward: ForwardModules
) -> None:
    """A defective unit's lane (columns j % lanes == lane) within some product it strikes."""
    lane = fault.settings.lane
    widest = max(p.width for n in targets for p in forward.product_traces[n])
    if lane >= widest:
        raise ConfigError(
            f"{key}.lane", f"{lane} is past every product '{fault.tensor}' names, the widest "
            f"{widest} columns: the unit could never strike; allowed: 0..{widest - 1}"
        )  # fmt: skip


def _struck(fault: FaultConfig, forward: ForwardModules, name: str) -> tuple[str, tuple[str, ...]]:
    """What a module fault strikes in `name`, and its dtypes as the forward trace recorded them:
    its output (activation); the `fault.product`-th product's output, or in backward the
    gradient of its second operand, which has the operand's dtype (a float32 weight's under
    autocast, where the product is 16-bit); every product, for a defective unit."""
    if fault.site == "activation":
        return "output", tuple(forward.outputs.get(name, ()))
    if fault.model == "defective_unit":
        return "products", tuple(forward.made.get(name, ()))
    traced = forward.product(name, fault.product)
    if fault.phase == "backward":
        return f"product {fault.product}'s second operand", traced.operand_dtypes
    return f"product {fault.product}", traced.dtypes


def _backward_reaches(
    key: str, fault: FaultConfig, targets: list[str], forward: ForwardModules
) -> None:
    """A backward matmul fault corrupts the gradient of the product's second operand: a frozen
    weight (requires_grad False) gets none, and the fault could never strike."""
    for name in targets:
        if forward.product(name, fault.product).operand_frozen:
            raise ConfigError(
                f"{key}.phase", f"backward: product {fault.product} of '{name}' multiplies a "
                "frozen weight, which no gradient reaches; allowed: forward"
            )  # fmt: skip


def _struck_dtypes(
    fault: FaultConfig, targets: list[str], forward: ForwardModules
) -> Iterator[tuple[str, str]]:
    """(what the fault strikes in a module, one of its dtypes) for every dtype the fault may
    strike in `targets`: under a mixed precision a module's output or products are 16-bit
    (autocast) where the workload's dtype is float32."""
    for name in targets:
        what, dtypes = _struck(fault, forward, name)
        for dtype in dtypes:
            yield f"{what} of '{name}'", dtype


def struck_width(
    fault: FaultConfig, model: torch.nn.Module, forward: ForwardModules | None
) -> int | None:
    """The bits of the narrowest dtype a module fault may strike in what it names (a 16-bit
    output or product under a mixed precision), or of the loss; None at the other sites, or
    with no forward traced, whose values are in the workload's dtype."""
    if forward is None:
        return None
    if fault.site == "loss":
        dtypes = set(forward.loss)
    elif fault.site in sites.MODULE_SITES:
        targets = [name for name, _ in sites.matching(fault, model, forward)]
        dtypes = {dtype for _, dtype in _struck_dtypes(fault, targets, forward)}
    else:
        return None
    return min((bits.width(getattr(torch, d)) for d in dtypes), default=None)


# (what the fault strikes, one of its dtypes): a module's output or product, the loss, a
# parameter's moments.
Struck = list[tuple[str, str]]


def check_moment_values(key: str, fault: FaultConfig, optimizer: torch.optim.Optimizer) -> None:
    """A fault at site optimizer against the dtypes of the moments a stepped optimizer holds (a
    user's optimizer may keep them in float32 beside 16-bit weights)."""
    dtypes = {
        str(state[m].dtype).removeprefix("torch.")
        for state in optimizer.state.values()
        for m in sites.MOMENTS
        if m in state
    }
    _values_in(key, fault, [("optimizer's moments", dtype) for dtype in sorted(dtypes)])


def _values_in(key: str, fault: FaultConfig, struck: Struck) -> None:
    """Every bit the fault names (its own, its schedule's) and what it writes, held by every
    dtype it strikes (a site whose dtype is not the workload's: the loss, a user's moments)."""
    named = [(f"{key}.bit", fault.bit)] if isinstance(fault.bit, int) else []
    named += [(f"{key}.schedule[{i}].bit", e["bit"]) for i, e in enumerate(fault.schedule)
              if e.get("bit") is not None]  # fmt: skip
    for at, bit in named:
        _bit_in_struck_dtype(at, bit, struck)
    _written_in_struck_dtypes(key, fault, struck)


def _bit_in_struck_dtype(key: str, bit: int, struck: Struck) -> None:
    """A bit index (`key`: the fault's, or a schedule entry's) within every dtype the fault may
    strike: a bit past one's width could never strike (the rank would raise)."""
    for what, dtype in struck:
        width = bits.width(getattr(torch, dtype))
        if bit >= width:
            raise ConfigError(
                key, f"{bit} is outside {dtype}, the dtype of the {what}; allowed: "
                f"0..{width - 1}, or a class (sign, exponent_msb, exponent, mantissa), drawn in "
                "the dtype struck"
            )  # fmt: skip


def _written_in_struck_dtypes(key: str, fault: FaultConfig, struck: Struck) -> None:
    """What a fault writes (its flipped bits, a scale, a value) held by every dtype it may
    strike, for a fault with a schedule as for one that draws (the workload's dtype says
    nothing of a module's outputs and products, of the loss, or of a user's optimizer's
    moments: harness/config/faults.py)."""
    if fault.nbits > 1:
        _bits_in_struck_dtype(key, fault, struck)
    if fault.factor is not None and "scale" in (fault.model, fault.burst_model):
        _scale_in_struck_dtype(key, fault, struck)
    if "value" in (fault.model, fault.burst_model):
        _value_in_struck_dtype(key, fault, struck)


def _bits_in_struck_dtype(key: str, fault: FaultConfig, struck: Struck) -> None:
    """`nbits` flipped bits within every dtype the fault may strike (the rank would raise)."""
    for what, dtype in struck:
        width = bits.width(getattr(torch, dtype))
        if fault.nbits > width:
            raise ConfigError(
                f"{key}.nbits", f"{fault.nbits} bits do not fit in {dtype}, the dtype of the "
                f"{what}; allowed: 1..{width}"
            )  # fmt: skip


def _value_in_struck_dtype(key: str, fault: FaultConfig, struck: Struck) -> None:
    """A finite value that every dtype the fault may strike stores as itself, not as an
    infinity or zero."""
    for what, dtype in struck:
        lost = unstored(fault.value, dtype)
        if lost is not None:
            stored, allowed = lost
            raise ConfigError(
                f"{key}.value", f"{fault.value} is stored as {stored:g} in {dtype}, the dtype of "
                f"the {what}; allowed: {allowed}"
            )  # fmt: skip


def _scale_in_struck_dtype(key: str, fault: FaultConfig, struck: Struck) -> None:
    """A scale factor that changes an element of the widest dtype the fault may strike: a
    module's output or products may be bfloat16 (autocast) where the workload's dtype is
    float32, and round away a factor float32 keeps."""
    dtypes = {dtype for _, dtype in struck}
    if not dtypes:
        return
    widest = max(dtypes, key=lambda dtype: FLOAT_FORMATS[dtype][1])
    least = unchanging_scale(widest)
    named = "the schedule" if fault.schedule else f"'{fault.tensor}'"
    if 0 < abs(fault.factor - 1) < least:
        raise ConfigError(
            f"{key}.factor", f"{fault.factor:g} rounds back to every element in {widest}, the "
            f"widest dtype of what {named} names at site {fault.site}: the fault "
            f"could never strike; allowed: |factor - 1| >= {least:g}"
        )  # fmt: skip


def _reaches_product(
    key: str, fault: FaultConfig, targets: list[str], forward: ForwardModules
) -> None:
    """Every module the fault may strike makes at least `fault.product` products in one run of
    its forward: a K it never reaches could never strike."""
    fewest = min(targets, key=lambda name: forward.products[name])
    most = forward.products[fewest]
    if fault.product > most:
        raise ConfigError(
            f"{key}.product", f"{fault.product} is never reached: '{fewest}' makes {most} "
            f"product{'s' * (most != 1)} per forward; allowed: 1..{most}"
        )  # fmt: skip


def _held(
    key: str, fault: FaultConfig, model: torch.nn.Module, names: list[str], shard_group: int
) -> list[int]:
    """The elements of the matched parameters that the fault's rank holds (the fewest over its
    ranks); a rank that holds none of them is refused: its fault could never strike."""
    params = dict(model.named_parameters())
    if fault.site == "optimizer":  # a moment, `NAME.exp_avg`, is shaped as its parameter
        params |= {f"{n}.{k}": p for n, p in params.items() for k in sites.MOMENTS}
    # scope reduction: the receivers of one shard, at the place of fault.ranks[0].
    ranks = fault.ranks[:1] if fault.scope == "reduction" else fault.ranks
    held: list[int] = []
    for rank in ranks:
        mine = [_chunk(params[name].shape, rank % shard_group, shard_group) for name in names]
        if not sum(mine):
            allowed = [
                r for r in range(shard_group)
                if sum(_chunk(params[n].shape, r, shard_group) for n in names)
            ]  # fmt: skip
            raise ConfigError(
                f"{key}.ranks",
                f"rank {rank} holds no element of '{fault.tensor}' at site {fault.site}: its "
                f"shard of dim 0 is empty; allowed: ranks at places "
                f"{', '.join(map(str, allowed))} of their shard group of {shard_group}",
            )
        if not held or sum(mine) < sum(held):
            held = mine
    return held


def _in_shard(
    key: str, fault: FaultConfig, model: torch.nn.Module, entry: dict, shard_group: int
) -> None:
    """A schedule entry's index within what its rank holds of its tensor: its index counts
    the rank's own shard's elements (past them the rank raised IndexError, a crash)."""
    params = dict(model.named_parameters())
    name = entry["tensor"]
    if fault.site == "optimizer":  # a moment, `NAME.exp_avg`, is shaped as its parameter
        name = next((n for n in params if name in {f"{n}.{k}" for k in sites.MOMENTS}), name)
    place = entry["rank"] % shard_group
    held = _chunk(params[name].shape, place, shard_group)
    if entry["index"] >= held:
        allowed = f"0..{held - 1}" if held else "a rank whose shard holds some of it"
        raise ConfigError(
            f"{key}.index", f"{entry['index']} is out of range: rank {entry['rank']} holds "
            f"{held} elements of '{entry['tensor']}' (its shard of dim 0, place {place} of "
            f"{shard_group}); allowed: {allowed}"
        )  # fmt: skip


def _chunk(shape: torch.Size, place: int, group: int) -> int:
    """Elements of a parameter of `shape` at `place` in a shard group of `group` ranks."""
    if not shape:
        return 1 if place == 0 else 0
    rows = -(-shape[0] // group)
    return max(0, min(shape[0], (place + 1) * rows) - place * rows) * math.prod(shape[1:])
