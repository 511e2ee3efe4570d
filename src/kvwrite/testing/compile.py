"""What ``torch.compile`` traces: the ops a function's captured graphs call."""

from __future__ import annotations

import torch

__all__ = ["compiled_targets"]


def compiled_targets(fn, *args) -> list[str]:
    """Compile ``fn`` (fullgraph) with a backend that records the captured FX graphs, run it on
    ``args``, and return the targets of their ``call_function`` nodes (``.default`` dropped), e.g.
    ``["kvwrite.reshape_and_cache_flash"]`` when the op stays one opaque custom op."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=recording_backend)(*args)
    return [str(n.target).removesuffix(".default") for g in graphs for n in g.graph.nodes
            if n.op == "call_function"]
