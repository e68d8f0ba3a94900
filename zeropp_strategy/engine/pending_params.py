"""Layer: engine. Parameters that collectives in flight are still writing, and the hooks
that make every reader of them wait.

[Note: waiting for parameters in flight]
Stage 1 all-gathers the updated rows after ``optimizer.step()`` and returns without
waiting ([Note: stage-1 asynchronous gather] in stage1.py). Until a bucket's gather has
finished, the rows that other ranks updated still hold their old values in this rank's
parameters, so whatever reads a parameter must first finish the work that writes it.
``PendingParams`` holds that work, one ``dist.Work`` per group of parameters (a bucket),
in the order it was issued, and puts three hooks on every module that directly owns one
of the parameters:
- a forward pre-hook: before the module computes, finish the groups holding its own
  parameters. Groups finish in issue order (waiting for group k first finishes every
  group before it), so whatever order a forward asks in, every rank finishes them in the
  same order: a two-hop gather issues its second hop when it is waited for, and gloo
  pairs collectives by their order;
- a ``state_dict`` pre-hook: checkpoints, ``full_model_state``, anything that copies the
  weights out;
- a ``load_state_dict`` pre-hook: a gather finishing after a load would overwrite it.
A parameter that a forward reads through another module (``x @ self.embed.weight.T`` in a
parent whose child ``embed`` has not run earlier in the same forward) is not waited for
by these hooks, nor is one read directly (``p.norm()`` in a callback): such code calls
the owner's ``wait()`` first.

Which modules: the optimizer that issues the gathers is handed over apart from the model
(every front-end builds them separately), so it does not know the modules. Until every
parameter's owner has its hooks, a global forward pre-hook
(``torch.nn.modules.module.register_module_forward_pre_hook``) looks at each module the
first time it is called and walks its submodules; the first forward after set-up (always
before the first step) calls the root, whose walk finds every owner, and the global hook
is removed. ``watch(module)`` does the same walk at once for a caller that has the module.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["PendingParams"]


class PendingParams:
    """Collectives in flight that write ``params``, finished by whoever reads them first.

    ``start(groups, works)`` after issuing (``works[i]`` writes ``groups[i]``);
    ``wait()`` finishes everything; the module hooks finish what a module needs. An error
    raised by a work's ``wait()`` is raised again by every later wait (the works are
    ``PendingWork``s, which keep it), so nothing reads parameters a failed gather left
    half-written.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._ids = frozenset(id(p) for p in params)
        self._unowned = set(self._ids)  # managed parameters whose owning module has no hooks yet
        self._group_of: dict[int, int] = {}  # id(param) -> index of the work writing it
        self._works: list[dist.Work | None] = []
        self._next = 0  # every work before this index has finished
        self._seen: set[int] = set()  # id() of modules already walked (ids: a module may be unhashable)
        self._discovery: RemovableHandle | None = None
        if self._ids:
            self._discovery = register_module_forward_pre_hook(self._discover)

    # -- the work --------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether some work has not finished (or failed: its wait raises again)."""
        return self._next < len(self._works)

    def start(self, groups: Sequence[Sequence[torch.Tensor]], works: Sequence[dist.Work | None]) -> None:
        """Record freshly issued work: ``works[i]`` writes the parameters ``groups[i]``."""
        if self.pending:
            raise RuntimeError("PendingParams.start: the previous work has not finished; call wait() first.")
        self._group_of = {id(p): i for i, group in enumerate(groups) for p in group}
        self._works = list(works)
        self._next = 0

    def wait_through(self, index: int) -> None:
        """Finish the works up to ``index`` (inclusive), in issue order."""
        while self._next <= index and self._next < len(self._works):
            work = self._works[self._next]
            if work is not None:
                work.wait()  # raises on failure; _next stays, so the next wait raises again
            self._works[self._next] = None
            self._next += 1

    def wait(self) -> None:
        """Finish every work (idempotent)."""
        self.wait_through(len(self._works) - 1)

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        """Finish the works writing any of ``params``."""
        if not self.pending:
            return
        last = max((self._group_of.get(id(p), -1) for p in params), default=-1)
        if last >= self._next:
            self.wait_through(last)

    # -- the hooks -------------------------------------------------------------------------

    def watch(self, root: nn.Module) -> None:
        """Hook every module under ``root`` (itself included) that directly owns a managed
        parameter; the global discovery hook goes once every managed parameter has an owner."""
        for module in root.modules():
            if id(module) in self._seen:
                continue
            self._seen.add(id(module))
            owned = [id(p) for p in module._parameters.values() if p is not None and id(p) in self._ids]
            if not owned:
                continue
            module.register_forward_pre_hook(self._before_forward)
            module.register_state_dict_pre_hook(self._before_state_dict)
            module.register_load_state_dict_pre_hook(self._before_load)
            self._unowned.difference_update(owned)
        if not self._unowned and self._discovery is not None:
            self._discovery.remove()
            self._discovery = None

    def _own(self, module: nn.Module) -> None:
        self.wait_for(p for p in module._parameters.values() if p is not None)

    def _discover(self, module: nn.Module, args: Any) -> None:  # noqa: ARG002 - a forward pre-hook
        if id(module) in self._seen:
            return
        self.watch(module)
        self._own(module)  # hooks added now do not run for this call

    def _before_forward(self, module: nn.Module, args: Any) -> None:  # noqa: ARG002
        if self.pending:
            self._own(module)

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:  # noqa: ARG002
        if self.pending:
            self._own(module)

    def _before_load(self, module: nn.Module, *args: Any) -> None:  # noqa: ARG002
        if self.pending:
            self._own(module)
