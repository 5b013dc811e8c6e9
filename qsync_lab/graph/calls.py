"""Name the functional calls of a running model exactly as the tracers name them.

A functional operator (``torch.matmul``, ``x @ y``, ``F.linear``, ``x + y``) has no module,
so its op FQN is ``scope.fn`` (``scope.fn_1`` for the second call in that scope), where
``scope`` is the innermost module whose forward made the call (:class:`OpNamer`). A
:class:`ScopedCalls` mode reproduces those names while the model runs: module hooks keep
the scope, a ``TorchFunctionMode`` sees every call, and calls inside op modules (a
``nn.Linear``'s own ``F.linear``) are not operators of the model. Subclasses override
:meth:`ScopedCalls.on_call` to record or replace calls (the hook tracer, the operators'
functional precisions, the indicator's statistics).

Example::

    >>> import torch, torch.nn as nn
    >>> class Attention(nn.Module):
    ...     def forward(self, x):
    ...         return torch.softmax(x @ x.transpose(-1, -2), -1)
    >>> class Names(ScopedCalls):
    ...     def on_call(self, name, fn_name, func, args, kwargs):
    ...         seen.append(name)
    ...         return func(*args, **kwargs)
    >>> seen, model, x = [], nn.Sequential(nn.Linear(3, 3), Attention()), torch.randn(2, 3)
    >>> with Names(model):
    ...     _ = model(x)
    >>> seen
    ['1.transpose', '1.matmul', '1.softmax']
"""

import functools

import torch.nn as nn
from torch.overrides import TorchFunctionMode

from qsync_lab.graph.kinds import is_leaf_module
from qsync_lab.graph.records import OpNamer

__all__ = ["ScopedCalls"]


class ScopedCalls(TorchFunctionMode):
    """A ``TorchFunctionMode`` that names each functional call of ``model`` by its op FQN.

    Use it as a context manager around forward passes (names restart at every ``with``),
    or :meth:`attach` it so that it enters around every forward of ``model``. Only calls
    made while the model's forward runs, outside its op modules, are named.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.namer = OpNamer()
        self.scope: list[str] = []
        self.leaf_depth = 0  # > 0 while inside an op module: its internals are not ops
        self._handles: list = []
        self._scope_hooks()

    def on_call(self, name: str, fn_name: str, func, args: tuple, kwargs: dict):
        """Handle the functional call ``name`` (``func(*args, **kwargs)`` by default)."""
        return func(*args, **kwargs)

    def is_op_module(self, module: nn.Module) -> bool:
        """Whether ``module`` is one op, whose internal calls are not operators."""
        return is_leaf_module(module)

    def enter_module(self, fqn: str, module: nn.Module) -> None:
        self.scope.append(fqn)
        if self.is_op_module(module):
            self.leaf_depth += 1

    def exit_module(self, fqn: str, module: nn.Module, inputs: tuple, kwargs: dict,
                    output) -> None:
        self.scope.pop()
        if self.is_op_module(module):
            self.leaf_depth -= 1

    def attach(self) -> None:
        """Enter this mode around every forward of the model (until :meth:`detach`)."""
        self._handles.append(self.model.register_forward_pre_hook(self._forward_begins))
        self._handles.append(self.model.register_forward_hook(self._forward_ends,
                                                              always_call=True))

    def detach(self) -> None:
        """Remove every hook this mode put on the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self):
        self.namer = OpNamer()
        self.scope.clear()
        self.leaf_depth = 0
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.leaf_depth:
            return func(*args, **(kwargs or {}))
        fn_name = getattr(func, "__name__", str(func))
        name = self.namer.function(self.scope[-1] if self.scope else "", fn_name)
        return self.on_call(name, fn_name, func, args, kwargs or {})

    def _forward_begins(self, model, args) -> None:
        self.__enter__()

    def _forward_ends(self, model, args, output) -> None:
        self.__exit__(None, None, None)

    def _scope_hooks(self) -> None:
        # bound methods and partials (not lambdas): a planned model deep-copies and pickles
        # with its hooks, and a copy's hooks then call the copy's mode
        for fqn, module in self.model.named_modules():
            if module is not self.model:
                self._handles.append(module.register_forward_pre_hook(
                    functools.partial(_enter, self, fqn)))
                self._handles.append(module.register_forward_hook(
                    functools.partial(_exit, self, fqn), with_kwargs=True, always_call=True))


def _enter(calls: ScopedCalls, fqn: str, module: nn.Module, args) -> None:
    calls.enter_module(fqn, module)


def _exit(calls: ScopedCalls, fqn: str, module: nn.Module, args, kwargs, output) -> None:
    calls.exit_module(fqn, module, args, kwargs, output)
