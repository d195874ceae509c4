"""The registry of what tf_nvlink replaced in Keras and TensorFlow: each patched attribute and its original.

Every seam module of this package patches through `REGISTRY.patch(owner, attribute, make_replacement)`, so one
call, `REGISTRY.restore()`, puts Keras and TensorFlow back (tests show with it what a patch changes).

Example:
    >>> from tf_nvlink.internals.registry import REGISTRY
    >>> REGISTRY.patch(SomeKerasClass, "method", lambda original: lambda self: original(self) + 1)
    True
    >>> REGISTRY.restore()           # SomeKerasClass.method is Keras' own again
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class UnsupportedKerasError(RuntimeError):
    """The installed Keras lacks the trainer internals per-replica XLA relies on."""


class Registry:
    """The patched attributes, their originals, and why the trainer seams could not be installed (`problem`)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.problem: str | None = None
        self._patches: dict[tuple[int, str], tuple[Any, str, Any, bool]] = {}

    def patch(self, owner, attribute: str, make_replacement: Callable[[Any], Any]) -> bool:
        """Set `owner.attribute` to `make_replacement(original)`, keeping the original; False (and nothing changed)
        when it is patched already. A class's own attribute is taken from its `__dict__`, so a subclass's method
        is never confused with its base's."""
        with self.lock:
            key = (id(owner), attribute)
            if key in self._patches:
                return False
            own = attribute in vars(owner)
            original = vars(owner)[attribute] if own else getattr(owner, attribute)
            setattr(owner, attribute, make_replacement(original))
            self._patches[key] = (owner, attribute, original, own)
            return True

    def patched(self, owner, attribute: str) -> bool:
        """Whether `owner.attribute` is replaced now."""
        return (id(owner), attribute) in self._patches

    def original(self, owner, attribute: str, default=None):
        """The original of a patched attribute (`default` when it is not patched)."""
        entry = self._patches.get((id(owner), attribute))
        return default if entry is None else entry[2]

    def restore(self, owner=None, attribute: str | None = None) -> None:
        """Put the originals back: of every patch, of every patch of `owner`, or of `owner.attribute`."""
        with self.lock:
            for key, (patched_owner, name, original, own) in list(self._patches.items()):
                if owner is not None and patched_owner is not owner or attribute is not None and name != attribute:
                    continue
                if own:
                    setattr(patched_owner, name, original)
                else:
                    delattr(patched_owner, name)
                del self._patches[key]


REGISTRY = Registry()
