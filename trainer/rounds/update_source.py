"""An accepted update as the coordinator holds it between its push and the round's close: compact,
decoded one dense tensor at a time.

A round's transition (trainer.rounds.transition) works tensor by tensor: for each parameter it decodes
that tensor of every accepted update, combines them, and takes the outer step, so no more than a
few dense tensors exist at once beyond θ, m and e. What it reads the updates through is an
``UpdateSource``:

    names()       the tensor names, sorted
    layout()      name → (dtype, shape), as trainer.codec.wire.layout_of gives for the dense update
    tensor(name)  the dense tensor, a fresh tensor the caller may keep or modify

Three kinds:
  ``trainer.codec.CompressedPayload``  a compressed push, checked whole and kept as its
                                             packed tensors (about the wire bytes); ``tensor``
                                             rebuilds Δ̂ᵢ's tensor bit for bit as ``decompress`` does
  ``DenseUpdate``                            a dict of dense tensors (a dense push, a stored dense
                                             record, tests)
  ``MergedUpdate``                           the union of a worker's stage slices, each a source

``source_of`` turns a plain dict into a ``DenseUpdate``, so functions taking sources take dicts too.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence, runtime_checkable

import torch

from trainer.codec.wire import Layout, Params, layout_of


@runtime_checkable
class UpdateSource(Protocol):
    def names(self) -> list[str]: ...

    def layout(self) -> Layout: ...

    def tensor(self, name: str) -> torch.Tensor: ...


class DenseUpdate:
    """Dense tensors by name; ``tensor`` hands out a copy, so the held tensors are never modified."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def layout(self) -> Layout:
        return layout_of(self.tensors)

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name].clone()


class MergedUpdate:
    """Δ̂ᵢ = ⋃ₛ Δ̂ᵢ,ₛ: a worker's stage slices, which partition the names."""

    def __init__(self, slices: Sequence[UpdateSource]) -> None:
        self.slices = list(slices)
        self._owner: dict[str, UpdateSource] = {}
        for piece in self.slices:
            for name in piece.names():
                if name in self._owner:
                    raise ValueError(f"tensor {name} is in two stage slices")
                self._owner[name] = piece

    def names(self) -> list[str]:
        return sorted(self._owner)

    def layout(self) -> Layout:
        out: Layout = {}
        for piece in self.slices:
            out.update(piece.layout())
        return {name: out[name] for name in sorted(out)}

    def tensor(self, name: str) -> torch.Tensor:
        return self._owner[name].tensor(name)


def source_of(update: UpdateSource | Mapping[str, torch.Tensor]) -> UpdateSource:
    """``update`` itself when it is a source, else its tensors as a ``DenseUpdate``."""
    if isinstance(update, Mapping):
        return DenseUpdate(update)
    return update


def dense(update: UpdateSource | Mapping[str, torch.Tensor]) -> Params:
    """Every tensor of ``update`` at once (tests, and what still needs the whole update)."""
    source = source_of(update)
    return {name: source.tensor(name) for name in source.names()}
