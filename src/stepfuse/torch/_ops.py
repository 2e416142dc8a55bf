"""`stepfuse._core.loop.Ops` over torch tensors: the shared step semantics inside the
compiled program (and the CUDA chunk)."""

from __future__ import annotations

import numpy as np
import torch

from .._core.loop import FunctionOps, Ops

__all__ = ["TORCH"]

_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


TORCH: Ops = FunctionOps(
    where=torch.where,
    isfinite=torch.isfinite,
    logical_not=torch.logical_not,
    equal=lambda a, b: a == b,  # torch's == is elementwise (and takes NumPy scalars)
    to_int=lambda x: x.to(torch.int64),
    cast=lambda x, dtype: x.to(_DTYPES[np.dtype(dtype)]),
    false=lambda: torch.tensor(False),
)
"""`Ops` for torch tensors (traced by dynamo into the fused program)."""
