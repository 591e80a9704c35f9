"""Weight gradients on their way from a worker to the fp32 gradient buffers.

After its last micro-batch of a round a fused or backward stage sends each layer's weight
gradients down as one flat fp32 tensor: one copy per layer (not one per tensor), into a host
buffer (pinned for GPU workers) the optimizer thread hands back to the board once it is done
with it, so the next rounds reuse it instead of allocating (and, for GPU workers, pinning) new
memory and handing the old back to the system. The squared norm of each tensor's gradient,
computed on the worker's device, rides at the tail of the same buffer.

A deposit that is the step's first contribution to every tensor of one optimizer unit, laid out
as the unit's gradient block, *becomes* that block (``HostState.adopt_grads``): no pass over it
on the host, and its norms are the ones the worker measured. Other deposits (a tied tensor's
second user, a second iteration of the step, a float16 loss scale to undo) are folded in by one
pass that also measures the norm (``kernels/fold.c``).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.parallel import kernels
from engine.parallel.board import Board
from engine.parallel.host import HostState
from engine.parallel.transfer import DeviceLink
from engine.scheduling.partition import Stage

# one layer's contribution: (host flat fp32 tensor, copy event, [(tensor key, offset, numel)],
# whether the buffer goes back to the board's pool)
Contribution = tuple[Any, Any, list[tuple[int, int, int]], bool]


def send_gradients(
    link: DeviceLink,
    board: Board,
    host: HostState,
    round_key: tuple[int, int],
    stage: Stage,
    params: dict[int, dict[str, torch.Tensor]],
    accum: dict[tuple[int, str], torch.Tensor] | None,
) -> None:
    """Deposit the weight gradients of ``stage``'s layers for (iteration serial, round).

    Args:
        accum: the fp32 accumulators by (layer, local name) when the stage summed its
            micro-batches' gradients in fp32 (a low-precision compute dtype); None: the
            parameters' own ``.grad`` are sent.
    """
    for i in reversed(stage.layers):  # top first: the order the fold takes them in
        parts: list[tuple[int, int, int]] = []
        grads: list[torch.Tensor] = []
        offset = 0
        for local, k in host.layer_keys[i].items():
            if not host.tensors[k].trainable:
                continue
            g = accum.pop((i, local), None) if accum is not None else params[i][local].grad
            if g is None:
                g = torch.zeros_like(params[i][local], dtype=torch.float32)
            parts.append((k, offset, g.numel()))
            offset += g.numel()
            grads.append(g.reshape(-1).float())
        if not grads:
            continue
        # each tensor's squared norm, on the device, at the buffer's tail
        norms = torch.stack([torch.linalg.vector_norm(g) for g in grads]).square()
        buffer = board.take_buffer(offset + len(grads))
        if link.is_cuda:
            sent, event = link.download(torch.cat([*grads, norms]), link.grad_down, into=buffer)
        elif buffer is not None:  # the worker writes the host buffer itself
            sent, event = torch.cat([*grads, norms], out=buffer), None
        else:
            sent, event = torch.cat([*grads, norms]), None
        with board.cv:
            board.deposits[(*round_key, i)] = (sent, event, parts, True)
            board.cv.notify_all()


def add_gradients(
    host: HostState, board: Board, contribution: Contribution, unscale: float, *, threads: int = 1
) -> None:
    """Add one layer's contribution into the fp32 gradient buffers (the optimizer thread;
    ``threads``: the fold kernel's)."""
    flat, event, parts, reusable = contribution
    DeviceLink.host_wait(event)
    owner = _adoptable(host, parts) if unscale == 1.0 and flat.dtype == torch.float32 else None
    if owner is not None:
        total = sum(numel for _, _, numel in parts)
        norms = flat[total : total + len(parts)].tolist()
        previous = host.adopt_grads(owner, flat, reusable=reusable)
        for (k, _, _), sq in zip(parts, norms, strict=True):
            host.unset.discard(k)
            host.grad_sq[k] = sq
        if previous is not None and previous[1]:
            board.give_buffer(previous[0])
        return
    fold = kernels.fold()
    for k, offset, numel in parts:
        master = host.tensors[k].master
        if master is None or master.grad is None:
            raise RuntimeError(f"gradient for frozen tensor {host.tensors[k].names}")
        grad = flat[offset : offset + numel].view(master.grad.shape)
        first = k in host.unset  # the step's first contribution: written, the buffer was not zeroed
        host.unset.discard(k)
        if fold is not None and flat.dtype == torch.float32 and flat.is_contiguous():
            # one pass: the write or add, and the buffer's squared norm for the step's global norm
            host.grad_sq[k] = fold(
                master.grad.data_ptr(), grad.data_ptr(), numel, unscale, 0 if first else 1, threads
            )
            continue
        host.grad_sq.pop(k, None)
        if first:
            if unscale == 1.0:
                master.grad.copy_(grad)
            else:
                torch.mul(grad, unscale, out=master.grad)
        elif unscale == 1.0:
            master.grad.add_(grad)
        else:
            master.grad.add_(grad, alpha=unscale)
    if reusable:
        board.give_buffer(flat)


def _adoptable(host: HostState, parts: list[tuple[int, int, int]]) -> int | None:
    """The unit whose gradient block a deposit can become: its parts are the unit's tensors in
    block order, and none has a contribution yet this step; None otherwise."""
    owner = host.tensors[parts[0][0]].owner
    keys = host.unit_keys(owner)
    if [k for k, _, _ in parts] != keys or any(k not in host.unset for k in keys):
        return None
    return owner
