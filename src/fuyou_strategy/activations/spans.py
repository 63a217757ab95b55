"""Each block's forward, backward and recomputation as spans of the recording trace (`fuyou_strategy.trace`)."""

from __future__ import annotations

from typing import Any

import torch

from .. import trace
from .swap import block_input, first_tensor, in_backward

__all__ = ["BlockSpans"]


class BlockSpans:
    """Hooks that put each block's forward, backward and recomputation on the ``compute`` lane of the recording
    tracer (no-ops while none records). Backward spans run from the gradient of the block's output to that of its
    input (tensor hooks), so they tile backward; a forward inside backward is a recomputation."""

    def __init__(self, blocks: list) -> None:
        self._handles = []
        self._starts: dict[int, float] = {}
        for i, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post(i), always_call=True))

    def _pre(self, i: int):
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            tracer = trace.active()
            if tracer is None or not torch.is_grad_enabled():  # training forwards only (not evaluation)
                return
            self._starts[i] = tracer.now()
            if in_backward():
                return
            x = block_input(args, kwargs)
            if x is not None and x.requires_grad:
                x.register_hook(self._backward_end(i))
        return hook

    def _post(self, i: int):
        def hook(module: Any, args: tuple, out: Any) -> None:
            tracer, start = trace.active(), self._starts.pop(i, None)
            if tracer is None or start is None:
                return
            recompute = in_backward()
            tracer.add("compute", f"{'recompute' if recompute else 'forward'} {i}", start, tracer.now(), block=i)
            y = first_tensor(out)
            if not recompute and y is not None and y.requires_grad:
                y.register_hook(self._backward_start(i))
        return hook

    def _backward_start(self, i: int):
        def hook(grad: Any) -> None:
            tracer = trace.active()
            if tracer is not None:
                self._starts[-1 - i] = tracer.now()  # negative keys: backward
        return hook

    def _backward_end(self, i: int):
        def hook(grad: Any) -> None:
            tracer, start = trace.active(), self._starts.pop(-1 - i, None)
            if tracer is not None and start is not None:
                tracer.add("compute", f"backward {i}", start, tracer.now(), block=i)
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
