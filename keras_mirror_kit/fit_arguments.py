"""A call of `fit`, `evaluate` or `predict` read as Keras' own parameters, whatever the override.

A model class may override these methods with a signature of its own: KerasHub's tasks
take `fit(x, y, batch_size, sample_weight, validation_data, validation_split, **kwargs)`,
so `callbacks`, `epochs` and `shuffle` arrive in `**kwargs`; a user's subclass may wrap
`fit(self, *args, **kwargs)`. `KerasCall.read` maps one call of the override onto the
parameters of `keras.Model`'s method of the same name, so that the kit reads and changes
them by Keras' names (`KerasCall.arguments`), and `KerasCall.call` gives the call back in
the override's form:

* a parameter of the override named as one of Keras' is that parameter, given
  positionally or by keyword;
* a keyword the override takes in `**kwargs` is Keras' parameter of that name;
* a positional argument in the override's `*args` is Keras' parameter at that position,
  when the override's named positional parameters are Keras' first ones (as in
  `fit(self, x, y=None, *args, **kwargs)`);
* anything else (a parameter of the override's own) is passed through as it was given.

A positional argument stays positional; one the kit removed becomes the override's
default (Keras' where the override names none); an argument the kit added goes by keyword
when the override takes it (by name or in `**kwargs`), and is left out when it does not.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["KerasCall"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@functools.cache
def _keras_parameters(method: str) -> dict[str, inspect.Parameter]:
    """Keras' `<method>` parameters after `self`, in order: its `Trainer`'s, which stay what
    they are when `keras.Model.<method>` itself is wrapped (the kit's `fit_hooks`, a test's
    recorder taking `*args, **kwargs`)."""
    from keras_mirror_kit.upstream import keras_private

    trainer = keras_private.base_trainer()
    parameters = list(inspect.signature(getattr(trainer, method)).parameters.values())
    return {p.name: p for p in parameters[1:] if p.kind in (*_POSITIONAL, *_NAMED)}


class KerasCall:
    """One call of an override of `fit`, `evaluate` or `predict`, by Keras' parameter names."""

    def __init__(
        self,
        method: str,
        signature: inspect.Signature,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        positional_names: list[str | None],
    ) -> None:
        self.method = method
        self._signature = signature
        self._args = args
        self._kwargs = kwargs
        self._positional_names = positional_names
        keras_names = _keras_parameters(method)
        #: The arguments given for Keras' parameters, by Keras' names; the kit changes these.
        self.arguments: dict[str, Any] = {
            name: value for name, value in zip(positional_names, args) if name is not None
        }
        self.arguments.update({k: v for k, v in kwargs.items() if k in keras_names})

    @classmethod
    def read(
        cls, method: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict
    ) -> KerasCall | None:
        """The call `args`, `kwargs` of a bound method with `signature`; None when it does
        not bind (the method itself then raises its own error)."""
        try:
            signature.bind_partial(*args, **kwargs)
        except TypeError:
            return None
        keras_order = list(_keras_parameters(method))
        named = [p for p in signature.parameters.values() if p.kind in _POSITIONAL]
        aligned = [p.name for p in named] == keras_order[: len(named)]
        positional_names: list[str | None] = []
        for index in range(len(args)):
            if index < len(named):
                name = named[index].name
                positional_names.append(name if name in keras_order else None)
            else:  # in the override's *args
                in_keras = aligned and index < len(keras_order)
                positional_names.append(keras_order[index] if in_keras else None)
        return cls(method, signature, tuple(args), dict(kwargs), positional_names)

    def _takes_keyword(self, name: str) -> bool:
        """Whether the override takes `name` by keyword (by name or in its `**kwargs`)."""
        for parameter in self._signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                return True
            if parameter.name == name and parameter.kind in _NAMED:
                return True
        return False

    def _default(self, index: int, name: str) -> Any:
        """The override's default of its positional parameter `index`, else Keras' of `name`."""
        named = [p for p in self._signature.parameters.values() if p.kind in _POSITIONAL]
        if index < len(named) and named[index].default is not inspect.Parameter.empty:
            return named[index].default
        default = _keras_parameters(self.method)[name].default
        return None if default is inspect.Parameter.empty else default

    def call(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments to call the override with: `arguments` in the override's form."""
        keras_names = _keras_parameters(self.method)
        args = list(self._args)
        placed = set()
        for index, name in enumerate(self._positional_names):
            if name is None:
                continue
            placed.add(name)
            args[index] = (
                self.arguments[name] if name in self.arguments else self._default(index, name)
            )
        kwargs = {k: v for k, v in self._kwargs.items() if k not in keras_names}
        for name, value in self.arguments.items():
            if name not in placed and self._takes_keyword(name):
                kwargs[name] = value
        return tuple(args), kwargs
