"""Weight gradients on their way from a worker to the fp32 gradient buffers.

After its last micro-batch of a round a fused or backward stage sends each layer's weight
gradients down as one flat fp32 tensor: one copy per layer (not one per tensor), into a pinned
buffer the optimizer thread hands back to the board once it has added the contents, so the next
rounds reuse it instead of pinning new memory.
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
    for i in stage.layers:
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
        flat = torch.cat(grads) if len(grads) > 1 else grads[0]
        buffer = board.take_buffer(flat.numel()) if link.is_cuda else None
        sent, event = link.download(flat, link.grad_down, into=buffer)
        with board.cv:
            board.deposits[(*round_key, i)] = (sent, event, parts, link.is_cuda)
            board.cv.notify_all()


def add_gradients(host: HostState, board: Board, contribution: Contribution, unscale: float) -> None:
    """Add one layer's contribution into the fp32 gradient buffers (the optimizer thread)."""
    flat, event, parts, reusable = contribution
    DeviceLink.host_wait(event)
    fold, threads = kernels.fold(), torch.get_num_threads()
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
