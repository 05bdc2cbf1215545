"""Data-parallel training of `CellModule`s: what DDP is told, and how sparse tables are synchronised.

DDP's reducer takes sparse gradients only from `nn.Embedding`, so the sparse tables of a
``CellModule(sparse=True)`` are DDP-ignored (from construction on for the module itself;
`ignore_sparse_tables_for_ddp` for a model that holds it) and synchronised by the module, in a process
group of its own (`_sparse_sync_group`): rank 0's values broadcast before the first forward with grad
enabled, each synced backward's sparse gradient averaged over the ranks (`_SparseAllReduce`), nothing under
DDP's ``no_sync()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from cortexc.torch.module import CellModule


def _ddp_syncs_this_backward() -> bool:
    """False inside the forward of a `DistributedDataParallel` under ``no_sync()`` (DDP then leaves the
    gradients to accumulate locally until the next synced backward); True otherwise, outside DDP too."""
    active = nn.parallel.DistributedDataParallel._get_active_ddp_module()
    return active is None or bool(active.require_backward_grad_sync)


class _SparseAllReduce(torch.autograd.Function):
    """Identity forward; the backward averages the table's sparse gradient over the group's ranks, as
    DDP averages a dense one: the ranks' rows and values gathered (padded to the largest count), put
    together in rank order and coalesced, so every rank gets bitwise the same sum, divided by the
    world size.

    What the table's ``.grad`` holds already (backwards under DDP's ``no_sync()``, which averaged
    nothing) is taken into the sum and the ``.grad`` cleared, so the table ends with the average of
    every rank's accumulated gradient, as DDP's buckets (which all-reduce the accumulated ``.grad``) give
    the dense params, bitwise the same on every rank (adding a rank's own part after averaging would not be)."""

    @staticmethod
    def forward(ctx: Any, table: Tensor, group: Any) -> Tensor:
        ctx.group = group
        ctx.table = table  # the leaf param: its accumulated .grad joins the average
        return table.view_as(table)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        import torch.distributed as dist

        world = dist.get_world_size(ctx.group)
        grad = grad if grad.is_sparse else grad.to_sparse(1)
        accumulated = ctx.table.grad
        if accumulated is not None:  # runs before the table's AccumulateGrad: it then takes the average
            grad = grad + (accumulated if accumulated.is_sparse else accumulated.to_sparse(1))
            ctx.table.grad = None
        grad = grad.coalesce()
        rows, values = grad.indices()[0], grad.values()
        count = torch.tensor([rows.numel()], dtype=torch.int64, device=rows.device)
        counts = [torch.empty_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=ctx.group)
        sizes = [int(c) for c in counts]
        most = max(sizes)
        padded_rows = rows.new_zeros(most)
        padded_rows[: rows.numel()] = rows
        padded_values = values.new_zeros((most, *values.shape[1:]))
        padded_values[: rows.numel()] = values
        all_rows = [torch.empty_like(padded_rows) for _ in range(world)]
        all_values = [torch.empty_like(padded_values) for _ in range(world)]
        dist.all_gather(all_rows, padded_rows, group=ctx.group)
        dist.all_gather(all_values, padded_values, group=ctx.group)
        indices = torch.cat([r[:n] for r, n in zip(all_rows, sizes)]).unsqueeze(0)
        values = torch.cat([v[:n] for v, n in zip(all_values, sizes)])
        summed = torch.sparse_coo_tensor(indices, values, grad.shape, check_invariants=False).coalesce()
        return summed / world, None


def ignore_sparse_tables_for_ddp(model: nn.Module) -> nn.Module:
    """Tell DDP to leave the sparse tables of every ``CellModule(sparse=True)`` inside `model` to
    their module (call it before ``DistributedDataParallel(model)``; `DDP(cell)` of a bare module needs
    nothing): DDP reads the names to ignore from the module it wraps, by their full names. Returns `model`."""
    from cortexc.torch.module import CellModule  # which imports this module

    names = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    for prefix, module in model.named_modules():
        if isinstance(module, CellModule):
            names += [alias for name in module.sparse_tables for alias in _ddp_names(prefix, name)]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(set(names)))
    return model


def _distributed() -> bool:
    """Whether this process is one of several ranks of an initialised default process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _ddp_names(prefix: str, name: str) -> list[str]:
    """The names DDP must find a param under to ignore it: its full name, and for a param of the
    wrapped module itself also ``.name`` too (DDP's reducer joins an empty module name with a dot)."""
    return [f"{prefix}.{name}"] if prefix else [name, f".{name}"]


def _sparse_sync_group(module: CellModule) -> Any:
    """The process group that synchronises `module`'s sparse tables, or None: only with grad enabled, in an
    initialised group of more than one rank (the tables are DDP-ignored from construction on; the
    params' own `_ddp_ignored` mark is not relied on, `copy.deepcopy` drops it), and not inside the
    forward of a DDP module that does not sync this backward (``no_sync()``: DDP's
    `require_backward_grad_sync`, read from the DDP module whose forward runs this one). Made (a group
    of its own, so that its collectives never interleave with DDP's buckets) and rank 0's tables
    broadcast on the first forward with grad enabled, synced or not, which every rank runs (as DDP's
    own forward requires)."""
    if not torch.is_grad_enabled() or not _distributed():
        return None
    import torch.distributed as dist

    tables = [getattr(module, name) for name in module.sparse_tables]
    if not any(t.requires_grad for t in tables):
        return None
    group = getattr(module, "_sparse_group", None)
    if group is None:
        group = dist.new_group()
        with torch.no_grad():
            for table in tables:
                dist.broadcast(table, src=dist.get_global_rank(group, 0), group=group)
        module.params_changed()  # the broadcast writes in place without moving the version counters
        module._sparse_group = group
    return group if _ddp_syncs_this_backward() else None
