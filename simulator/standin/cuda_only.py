"""CPU kernels for aten operators that have a CUDA kernel only, which torch reaches because a stand-in *is* CUDA.

torch's recurrent layers take fused cells on CUDA tensors (``nn.LSTM``, ``nn.GRU``,
``nn.LSTMCell``, ``nn.GRUCell`` without cuDNN: ``_thnn_fused_lstm_cell``,
``_thnn_fused_gru_cell``), and autograd calls their fused backwards; none of the four has a
CPU kernel.  Each is computed here from CPU operators with the CUDA kernel's contract: the
same inputs, outputs and *workspace* (the activated gates the backward reads), so torch's
autograd formulas pair them as on a GPU.  The maths, with ``σ`` the sigmoid:

LSTM: gates = input_gates + hidden_gates (+ both biases), split in four along dim 1 as
``i, f, g, o`` → ``i, f, o = σ(·)``, ``g = tanh(·)``; ``c' = f c + i g``, ``h' = o tanh(c')``;
workspace ``[i, f, g, o]``.  Backward, with ``t = tanh(c')``:
``dc = dh o (1 - t²) + dc'``, ``di = dc g i(1-i)``, ``df = dc c f(1-f)``, ``dg = dc i (1-g²)``,
``do = dh t o(1-o)``, ``dc_prev = dc f``; the bias gradient is the gates' summed over the batch.

GRU: ``r = σ(x_r + h_r)``, ``z = σ(x_z + h_z)``, ``n = tanh(x_n + r h_n)``,
``h' = n + z (h - n)``; workspace ``[r, z, n, h_n, h - n]``.  Backward:
``dz = dh (h - n) z(1-z)``, ``dx_n = dh (1-z)(1-n²)``, ``dh_n = dx_n r``,
``dr = dx_n h_n r(1-r)``, ``dh_prev = dh z``; input gates' gradient ``[dr, dz, dx_n]``, hidden
gates' ``[dr, dz, dh_n]``.

(``tests/test_sim_standin_programs.py`` checks outputs and gradients against the CPU's own layers.)
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["CPU_KERNELS"]


def _added(gates: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gates if bias is None else gates + bias


def _lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
               input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gates = _added(_added(input_gates, input_bias), hidden_bias) + hidden_gates
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat((i, f, g, o), 1)


def _lstm_cell_backward(grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None, cx: torch.Tensor,
                        cy: torch.Tensor, workspace: torch.Tensor, has_bias: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    i, f, g, o = workspace.chunk(4, 1)
    t = cy.tanh()
    dh = torch.zeros_like(cy) if grad_hy is None else grad_hy
    dc = dh * o * (1 - t * t)
    if grad_cy is not None:
        dc = dc + grad_cy
    grad_gates = torch.cat((dc * g * i * (1 - i), dc * cx * f * (1 - f), dc * i * (1 - g * g),
                            dh * t * o * (1 - o)), 1)
    return grad_gates, dc * f, grad_gates.sum(0) if has_bias else None


def _gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
              input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    xr, xz, xn = _added(input_gates, input_bias).chunk(3, 1)
    hr, hz, hn = _added(hidden_gates, hidden_bias).chunk(3, 1)
    r = (xr + hr).sigmoid()
    z = (xz + hz).sigmoid()
    n = (xn + r * hn).tanh()
    h_minus_n = hx - n
    return n + z * h_minus_n, torch.cat((r, z, n, hn, h_minus_n), 1)


def _gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                  torch.Tensor | None]:
    r, z, n, hn, h_minus_n = workspace.chunk(5, 1)
    dz = grad_hy * h_minus_n * z * (1 - z)
    dxn = grad_hy * (1 - z) * (1 - n * n)
    dr = dxn * hn * r * (1 - r)
    grad_input = torch.cat((dr, dz, dxn), 1)
    grad_hidden = torch.cat((dr, dz, dxn * r), 1)
    if not has_bias:
        return grad_input, grad_hidden, grad_hy * z, None, None
    return grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)


#: operator name (``schema.name`` with its overload) -> a kernel on CPU tensors (read by ``tensor._Spec``)
CPU_KERNELS: dict[str, Callable[..., Any]] = {
    "aten::_thnn_fused_lstm_cell": _lstm_cell,
    "aten::_thnn_fused_lstm_cell_backward_impl": _lstm_cell_backward,
    "aten::_thnn_fused_gru_cell": _gru_cell,
    "aten::_thnn_fused_gru_cell_backward": _gru_cell_backward,
}
