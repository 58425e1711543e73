"""fp16's loss scaler for gradients that are DTensors (tp, and FSDP2's shards), beside plain tensors."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor


class DTensorGradScaler(ShardedGradScaler):
    """fp16's loss scaler for gradients that are DTensors, beside plain ones or on several meshes.

    One foreach unscale cannot take plain tensors and DTensors together (torch raises "got mixed torch.Tensor and
    DTensor"), and tp leaves whole whatever its plan does not split (norms). Unscaling is elementwise, so each rank
    unscales the elements it holds, without DTensor's collective per group of gradients; unscale_ then sums the
    overflow flags over every rank, so all skip the same steps (one slice alone may overflow)."""

    def _unscale_grads_(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool = True
    ) -> dict[torch.device, torch.Tensor]:
        # The parent reads only param_groups' gradients: a DTensor's stands in as its local tensor, which shares its
        # storage (a plain gradient's parameter is passed as it is: the parent may replace a sparse gradient).
        with torch.no_grad():
            params = [
                SimpleNamespace(grad=param.grad.to_local()) if isinstance(param.grad, DTensor) else param
                for group in optimizer.param_groups
                for param in group["params"]
            ]
        local = SimpleNamespace(param_groups=[{"params": params}])
        return super()._unscale_grads_(local, inv_scale, found_inf, allow_fp16)
