"""Per-step scalars computed once a step, not once per element (an inductor graph pass).

torch's update rules compute a step's scalars from the carried ``step`` tensor: Adam's bias
corrections ``1 - beta ** step`` and their square roots (in float64, as eager torch reads
``step`` as a Python float). Inductor inlines such a 0-dim expression into every kernel
that reads it, and its C++ loops evaluate it at each iteration: two ``std::pow`` and a
``sqrt`` per 16 elements of every parameter. On the 2-core CPU VM that was ~0.5 ms of
an MLP 784-256-10's 1.2 ms Adam step (2026-12-07, the "mnist" data problem).

`RealizeScalars` gives each such expression, where a large tensor reads it, a buffer of
its own: an identity ``as_strided`` of it, which inductor lowers by realizing its input
(one tiny kernel computes the scalars once; the large kernels load them). The values are
the same (the same operations, once); only where they are computed changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["LARGE", "RealizeScalars"]

LARGE = 256
"""A consumer of at least this many elements reads a computed scalar from a buffer (below
it, inductor's inlined expression costs less than a kernel of its own)."""


def _numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)):
        return max((_numel(v) for v in value), default=0)
    return 0


class RealizeScalars(CustomGraphPass):
    """The post-grad pass (``post_grad_custom_post_pass``): an identity ``as_strided``
    between each computed one-element floating-point tensor and its large consumers."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        as_strided = torch.ops.aten.as_strided.default
        for node in list(graph.nodes):
            val = node.meta.get("val")
            if (
                node.op != "call_function"
                or not isinstance(node.target, torch._ops.OpOverload)
                or node.target.is_view  # (a view of a larger tensor: left as it is)
                or not isinstance(val, torch.Tensor)
                or val.numel() != 1
                or not val.is_floating_point()
                or not any(isinstance(a, torch.fx.Node) for a in node.all_input_nodes)
            ):
                continue
            large = [u for u in node.users if _numel(u.meta.get("val")) >= LARGE]
            if not large:
                continue
            with graph.inserting_after(node):
                held = graph.call_function(as_strided, (node, list(val.shape), list(val.stride())))
            held.meta["val"] = val
            for user in large:
                user.replace_input_with(node, held)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))
