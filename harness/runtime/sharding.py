"""Sharded data parallelism (FSDP2, HSDP): torch's `fully_shard` with the harness's sites on its
collectives, the sharded counterpart of the DDP comm hook (harness/runtime/comm.py).

Entry contract: the default process group is up (gloo on the CPU, NCCL on GPUs), every rank
built the model from the same seed (its weights identical, as `Workload.build_model` makes
them: `fully_shard` slices them, it broadcasts nothing), and the model is on `mesh`'s device.
The caller makes `mesh(...)` once, calls `shard(model, mesh, sites)` once, before building the
optimizer (which must see the sharded parameters), and trains the returned model as usual:
forward, backward, optimizer step. A module the user wrapped with `fully_shard` themselves (the
guard in a user's loop) takes the same sites through `install(model, sites)`, its groups as the
user made them.

Why: a sharded step moves data through collectives DDP never runs, so a fault has sites of
its own. Before the reduce-scatter each rank holds its whole local gradient (`grad`); after it,
only its shard of the reduced gradient (`allreduce`, generalised: `received`); each forward, and
each backward that re-gathers, every rank copies every other rank's parameter shard into its own
unsharded weight (`gather`, new: a shard corrupted on its way into one rank's weight changes
that rank's forward only, while the stored shard stays intact).

Mechanisms, all through FSDP2's own extension points:
- Groups: `fully_shard` on each child of an `nn.ModuleList` (the outermost lists only: GPT's
  `blocks[i]`, a transformers Llama's `model.layers[i]`; a list inside a block stays with its
  block), in definition order, then on the root for what is left (embeddings, final norm,
  head). Group `i` in a site's `GroupLayout` is this wrap order, the root last. A model without
  a ModuleList is one group.
- Comms: each group gets a `ReduceScatter` and an `AllGather` of the harness's
  (`set_custom_reduce_scatter`, `set_custom_all_gather`) that issue exactly the collective
  FSDP's defaults issue, `dist.reduce_scatter_single` and `dist.all_gather_single` with the op,
  group and async flag FSDP passes, so a clean run is bit-identical to plain `fully_shard`.
  Under HSDP, FSDP all-reduces the reduce-scattered shard across replicas with a plain
  `dist.all_reduce` that takes no custom comm; `set_all_reduce_hook` sees its result.
- What FSDP passes (torch 2.13, float32 and bfloat16 gradients, no divide factor set): op
  `ReduceOp.AVG` for the reduce-scatter and HSDP's all-reduce, no pre- or post-divide; float16
  (overflow risk) gets `SUM` with a pre-divide by about sqrt(N) and a post-divide by the rest,
  the post-divide after the all-reduce hook. Gloo has no reduce-scatter of its own: its
  `reduce_scatter_single` all-reduces the whole input and copies out this rank's chunk.
- When the sites run: `local_gradients` in the reduce-scatter comm, before the collective, on
  the flat input (after any pre-divide); `received` after the collective; `gathered` after the
  all-gather, before FSDP copies the flat output into the parameters. FSDP calls the
  reduce-scatter synchronously (on a GPU: on its reduce-scatter stream, where the callback's
  kernels queue behind the collective without blocking the host). An all-gather that FSDP
  issues with `async_op` (explicit prefetch, `unshard(async_op=True)`) returns a `Work` wrapped
  so that `wait()` runs `gathered` once the collective is done: FSDP waits on it only when it
  needs the parameters, so the overlap is kept. A callback that reads a value on the host
  synchronises there, as any check does.

Fixed layout, for a run's whole life: `fully_shard` groups parameters by module once, at wrap
time, and lays a group's flat buffers out the same way at every step: `(shard group size,
shard numel)`, row `r` the concatenation, in the group's parameter order, of rank `r`'s dim-0
chunk of each parameter, padded to an equal chunk (`GroupLayout.spans`). What would change it:
a parameter without a gradient drops out of the reduce-scatter input (FSDP skips it), which
shifts every later offset; the comm refuses that step, as the harness's DDP refuses a
parameter that gets no gradient. No bucket is rebuilt, so a run that starts mid-way from a
checkpoint (fast-forward, recovery, resume) reduces its first step exactly as the straight run
did. `reshard_after_forward`: True for the blocks (torch's default for non-root modules, what
users run: the memory of ZeRO-3, and an all-gather in backward too, so the `gather` site has a
backward half that reaches gradients only), False for the root, whose parameters backward needs
first (torch's default for the root).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    FSDPMeshInfo,
    HSDPMeshInfo,
    TrainingState,
)
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from harness.core import inflight
from harness.core.vocabulary import Parallel

PARALLEL = (Parallel.FSDP.value, Parallel.HSDP.value)


def mesh(parallel: str, world_size: int, shard_size: int, device_type: str) -> DeviceMesh:
    """The device mesh of `topology.parallel`: fsdp, one dimension "shard" over the world
    (`shard_size` unused); hsdp, `(world_size // shard_size, shard_size)` named ("replicate",
    "shard"), each shard group `shard_size` consecutive ranks. Every rank calls it together."""
    if parallel == "fsdp":
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    if parallel != "hsdp":
        raise ValueError(f"topology.parallel={parallel!r} has no mesh: it is one of {PARALLEL}.")
    if not 2 <= shard_size <= world_size:
        raise ValueError(
            f"topology.shard_size={shard_size} must be between 2 and the world size "
            f"{world_size}, since a shard group of one rank reduce-scatters nothing."
        )
    if world_size % shard_size:
        raise ValueError(
            f"topology.shard_size={shard_size} does not divide the world of {world_size} "
            "ranks into equal shard groups."
        )
    return init_device_mesh(
        device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
    )


@dataclass(frozen=True)
class Span:
    """One parameter in its group's flat buffers: `length` elements (its dim-0 chunk, padded)
    from `offset` in every rank's row; `shape` the unsharded parameter's."""

    name: str
    offset: int
    length: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class GroupLayout:
    """An FSDP group's flat buffers, what every site names a tensor by. A reduce-scatter input
    and an all-gather output are `(world, shard_numel)` row-major, row `r` rank `r`'s shard; a
    reduce-scatter output is this rank's row."""

    index: int  # in wrap order, the root last
    module: str  # the wrapped module's name, "" for the root
    world: int  # ranks in the shard group
    rank: int  # this rank's place in it
    spans: tuple[Span, ...]

    @property
    def shard_numel(self) -> int:
        return sum(span.length for span in self.spans)

    def span(self, name: str) -> Span:
        return next(span for span in self.spans if span.name == name)

    def unsharded(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Parameter `name`, whole, from a `(world, shard_numel)` buffer (a copy)."""
        span = self.span(name)
        rows = flat.view(self.world, -1)[:, span.offset : span.offset + span.length]
        return rows.reshape(-1)[: math.prod(span.shape)].view(span.shape)

    def shard(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's padded chunk of parameter `name` in a shard-sized buffer (a view)."""
        span = self.span(name)
        return flat[span.offset : span.offset + span.length]


def predivide(world_size: int) -> int:
    """What FSDP2 divides a summed (float16) reduce-scatter input by before the collective, the
    rest of the mean after it: torch's `_get_gradient_divide_factors` with no divide factor set
    (2 on 2 or 4 ranks, 4 on 8). Exact, a power of two, but where a quotient is subnormal."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return factor


@dataclass(frozen=True)
class ShardSites:
    """The harness's callbacks on a sharded step's collectives, None where nothing runs. Each
    may change its tensor in place (a fault) or only read it (a check).

    - local_gradients(layout, flat, averaged): this rank's local gradient, the reduce-scatter
      input, before the collective (the `grad` site); `averaged` when the collectives average
      (`ReduceOp.AVG`, float32 and bfloat16) rather than sum (float16's pre-divided input);
    - received(layout, stage, shard): the reduced shard this rank receives, after the
      collective; stage "reduce_scatter", and under HSDP then "all_reduce" for the result of
      the all-reduce across replicas, the gradient the optimizer steps on (the `allreduce`
      site);
    - gathered(layout, backward, flat): the all-gathered parameters, before they become this
      rank's unsharded weights; `backward` for backward's re-gather (the `gather` site).
    """

    local_gradients: Callable[[GroupLayout, torch.Tensor, bool], None] | None = None
    received: Callable[[GroupLayout, str, torch.Tensor], None] | None = None
    gathered: Callable[[GroupLayout, bool, torch.Tensor], None] | None = None


def shard(model: nn.Module, mesh: DeviceMesh, sites: ShardSites) -> nn.Module:
    """`model` sharded in place over `mesh` (blocks, then the root), the sites installed on
    every group's collectives; the model, now an FSDPModule."""
    _refuse_frozen(model)
    for block in blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    install(model, sites)
    return model


def install(model: nn.Module, sites: ShardSites) -> int:
    """The sites on the collectives of every FSDP group in `model`, a module that `fully_shard`
    wrapped (the root, and whichever of its submodules the caller wrapped before it); how many
    groups it has. What the sites are not derived for is refused (ValueError, one line): a
    module not wrapped, frozen parameters, a mixed precision policy, shards of another dim than
    0, a comm or hook that is already custom."""
    if not isinstance(model, FSDPModule):
        raise ValueError(
            f"a {type(model).__name__} is not sharded: call fully_shard on the root module too"
        )
    _refuse_frozen(model)
    names = {id(p): name for name, p in model.named_parameters()}
    found = groups(model)
    for name, _, group in found:
        _refuse_unsupported(name or "root", group)
    for index, (name, module, group) in enumerate(found):
        info = group.mesh_info
        spans = _spans(group, names, info.shard_mesh_size)
        layout = GroupLayout(index, name, info.shard_mesh_size, info.shard_mesh_rank, spans)
        module.set_custom_reduce_scatter(_ReduceScatter(layout, sites))
        module.set_custom_all_gather(_AllGather(layout, sites, group))
        if isinstance(info, HSDPMeshInfo) and sites.received is not None:
            module.set_all_reduce_hook(_AfterAllReduce(sites.received, layout))
    return len(found)


def groups(model: nn.Module) -> list[tuple[str, FSDPModule, FSDPParamGroup]]:
    """The FSDP groups of a module that `fully_shard` wrapped, as (module name, module, group):
    group `i` the i-th wrapped module with parameters of its own in definition order, the root
    (named "") last, as its reduce-scatter runs last in backward."""
    wrapped = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule) and n]
    found = []
    for name, module in [*wrapped, ("", model)]:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None:
            found.append((name, module, group))
    return found


def parallelism(model: nn.Module) -> tuple[str, int]:
    """How a module that `fully_shard` wrapped trains: ("fsdp", shard group size) over a 1-D
    mesh, ("hsdp", shard group size) over a 2-D replicate x shard mesh."""
    group = next(
        m._get_fsdp_state()._fsdp_param_group
        for m in model.modules()
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
    )
    info = group.mesh_info
    return ("hsdp" if isinstance(info, HSDPMeshInfo) else "fsdp"), info.shard_mesh_size


def _refuse_frozen(model: nn.Module) -> None:
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        # FSDP leaves a frozen parameter out of the reduce-scatter but not the all-gather: the
        # two buffers would need layouts of their own.
        raise ValueError(f"sharding trains every parameter, and {', '.join(frozen)} is frozen.")


def _refuse_unsupported(name: str, group: FSDPParamGroup) -> None:
    """What the sites' fixed layout and the checks' bounds are not derived for."""
    if not isinstance(group.mesh_info, FSDPMeshInfo):
        raise ValueError(f"FSDP group {name} replicates without sharding (replicate()).")
    policy = group.mp_policy
    if policy.param_dtype is not None or policy.reduce_dtype is not None:
        raise ValueError(
            f"FSDP group {name} has a MixedPrecisionPolicy (param_dtype={policy.param_dtype}, "
            f"reduce_dtype={policy.reduce_dtype}); the checks are derived for fully_shard's "
            "default precision: use torch.autocast for mixed precision."
        )
    other = [p for p in group.fsdp_params if p.fsdp_placement.dim != 0]
    if other:
        raise ValueError(
            f"FSDP group {name} shards a parameter on dim {other[0].fsdp_placement.dim}, not 0."
        )
    # An earlier guard's sites (closed, they pass through) are replaced like fully_shard's own.
    custom = not isinstance(
        group._reduce_scatter_comm, DefaultReduceScatter | _ReduceScatter
    ) or not isinstance(group._all_gather_comm, DefaultAllGather | _AllGather)
    hook = group._all_reduce_hook
    if custom or (hook is not None and not isinstance(hook, _AfterAllReduce)):
        raise ValueError(f"FSDP group {name} has a custom collective or all-reduce hook already.")


class _AfterAllReduce:
    """HSDP's all-reduce hook for one group: `received` on the result across replicas."""

    def __init__(
        self, received: Callable[[GroupLayout, str, torch.Tensor], None], layout: GroupLayout
    ) -> None:
        self.received, self.layout = received, layout

    def __call__(self, out: torch.Tensor) -> None:
        self.received(self.layout, "all_reduce", out)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the outermost ModuleLists, in definition order."""
    blocks: list[nn.Module] = []
    inside: set[str] = set()
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if isinstance(module, nn.ModuleList):
            inside.add(name)
            blocks.extend(module)
    return blocks


def _spans(group: FSDPParamGroup, names: dict[int, str], world: int) -> tuple[Span, ...]:
    spans, offset = [], 0
    for param in group.fsdp_params:
        length = param.padded_sharded_param_size.numel()
        shape = tuple(param._orig_size)
        spans.append(Span(names[id(param.sharded_param)], offset, length, shape))
        offset += length
    return tuple(spans)


class _Then(dist.Work):
    """A collective's Work whose first `wait()` runs `then` once the collective is done."""

    def __init__(self, work: dist.Work, then: Callable[[], None]):
        super().__init__()
        self._work, self._then = work, then

    def wait(self, timeout: object = None) -> bool:
        self._work.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True


class _PlainBuffers:
    """FSDP's default buffers: a fresh tensor for each collective."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _ReduceScatter(_PlainBuffers, ReduceScatter):
    """FSDP's default reduce-scatter, with `local_gradients` before it and `received` after."""

    def __init__(self, layout: GroupLayout, sites: ShardSites):
        self.layout, self.sites = layout, sites

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        layout = self.layout
        if input_tensor.numel() != layout.world * layout.shard_numel:
            raise RuntimeError(
                f"FSDP group {layout.index} ({layout.module or 'root'}) reduce-scatters "
                f"{input_tensor.numel()} elements where its fixed layout has "
                f"{layout.world * layout.shard_numel}: a parameter got no gradient"
            )
        if self.sites.local_gradients is not None:
            if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
                # PREMUL_SUM: only with a gradient divide factor, which the harness never sets.
                raise RuntimeError(f"FSDP group {layout.index} reduce-scatters with {op}")
            self.sites.local_gradients(layout, input_tensor, op == dist.ReduceOp.AVG)
        work = dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )
        # The input only: FSDP keeps the output, whose views become the gradients.
        inflight.hold(input_tensor)
        received = self.sites.received
        if received is None:
            return work
        if async_op:
            return _Then(work, lambda: received(layout, "reduce_scatter", output_tensor))
        received(layout, "reduce_scatter", output_tensor)
        return work


class _AllGather(_PlainBuffers, AllGather):
    """FSDP's default all-gather, with `gathered` on its output once it is complete."""

    def __init__(self, layout: GroupLayout, sites: ShardSites, group: FSDPParamGroup):
        self.layout, self.sites, self.group = layout, sites, group

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        inflight.hold(input_tensor, output_tensor)
        gathered = self.sites.gathered
        if gathered is None:
            return work
        # The group's state when FSDP unshards it, also for a prefetch on another's behalf.
        backward = self.group._training_state == TrainingState.PRE_BACKWARD
        if async_op:
            return _Then(work, lambda: gathered(self.layout, backward, output_tensor))
        gathered(self.layout, backward, output_tensor)
        return work
