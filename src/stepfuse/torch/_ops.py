"""`stepfuse._core.loop.Ops` over torch tensors: the shared step semantics inside the
compiled program (and the CUDA chunk)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._core import Ops

__all__ = ["TORCH"]

_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


class _TorchOps:
    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return torch.where(cond, a, b)

    @staticmethod
    def isfinite(x: Any) -> Any:
        return torch.isfinite(x)

    @staticmethod
    def logical_not(x: Any) -> Any:
        return torch.logical_not(x)

    @staticmethod
    def to_int(x: Any) -> Any:
        return x.to(torch.int64)

    @staticmethod
    def cast(x: Any, dtype: np.dtype) -> Any:
        return x.to(_DTYPES[np.dtype(dtype)])

    @staticmethod
    def false() -> Any:
        return torch.tensor(False)


TORCH: Ops = _TorchOps()
"""`Ops` for torch tensors (traced by dynamo into the fused program)."""
