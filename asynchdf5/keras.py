"""Keras 3: a layer's batches for ``model.fit``, one layer epoch per Keras epoch, resumed exactly.

:class:`PyDataset` is a ``keras.utils.PyDataset`` over an open sync layer
(:class:`~asynchdf5.HDF5DataLayer` or :class:`~asynchdf5.MemoryDataLayer`): it maps each batch's
tops to ``(x, y[, sample_weight])``, tells Keras the steps of the epoch (``num_batches``), and
serves each Keras epoch from one epoch of the layer. :class:`Position` is the callback that makes
its :meth:`PyDataset.state_dict` exact. Install with ``pip install ".[keras]"`` (in the
asynchdf5 checkout) and a backend (JAX, PyTorch or TensorFlow); ``import asynchdf5`` never
imports Keras.

How it fits Keras, for whoever carries it on:

* **Keras reads ahead.** It takes one batch before training to build the model (and resets), on
  a GPU the JAX backend fetches one batch ahead, and a worker pool more. So the layer's position
  is not the training's: the dataset takes the layer's state right after each batch it takes
  (:meth:`~asynchdf5.HDF5DataLayer.state_dict` counts batches handed over), and the callback
  says, after each trained batch, how many of the epoch were trained; the state is the one taken
  after that many. States of batches already trained are dropped, so a few are kept at a time.
* **Keras restarts an epoch's indices after its look.** Batches served in a pass outside a
  training epoch (its build look, one batch, before ``on_train_begin``; :class:`Position` says
  when an epoch begins and ends) are served again, in order, at the next pass: the layer's
  epoch goes on, nothing is skipped or repeated, even when the look took all that was left.
* **Keras asks for indices, the layer has an order.** ``__getitem__`` serves the layer's next
  batch whatever the index (``fit(shuffle=True)`` permutes the indices; the layer's own
  ``shuffle`` is what mixes). A worker pool (``workers > 1``) would ask from several threads:
  refused.
* **Keras counts the same steps in every epoch of one ``fit``.** It reads ``num_batches`` at
  the start of ``fit``; a fit that starts in the middle of a layer epoch (after a resume) has
  only that epoch's rest, so it must end with that epoch: :class:`Position` checks at the start
  of ``fit`` and of every epoch that Keras's epoch and steps are the layer's, and raises a
  :class:`~asynchdf5.StateError` saying what to do otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

try:
    import keras
except ImportError as exc:  # pragma: no cover - tested where Keras is missing
    raise ImportError(
        'asynchdf5.keras needs Keras 3, which is not installed: pip install ".[keras]" '
        "in the asynchdf5 checkout"
    ) from exc

from ._batch import Batch
from ._errors import ConfigurationError, StateError
from ._layer import LayerBase
from ._ragged import check_dense
from ._resume import batches_before

__all__ = ["Position", "PyDataset"]

#: Batches of a pass Keras ends early that are served again (its build look takes one).
_REPLAY = 4

Tops = str | Sequence[str] | Mapping[str, str]


def _pick(batch: Batch, tops: Tops) -> Any:
    if isinstance(tops, str):
        return batch[tops]
    if isinstance(tops, Mapping):
        return {name: batch[top] for name, top in tops.items()}
    return tuple(batch[top] for top in tops)


def _names(tops: Tops | None) -> list[str]:
    if tops is None:
        return []
    if isinstance(tops, str):
        return [tops]
    if isinstance(tops, Mapping):
        return list(tops.values())
    return list(tops)


class PyDataset(keras.utils.PyDataset):  # type: ignore[misc]
    """A layer's batches for ``model.fit``, as ``(x, y[, sample_weight])``.

    Each Keras epoch is one epoch of the layer (``len()`` / ``num_batches`` is its batch count
    on this rank), so ``model.fit(data, epochs=n)`` trains on ``n`` epochs of data. Pass a
    :class:`Position` callback to ``fit`` (``data.position``) for an exact :meth:`state_dict`.

    Parameters
    ----------
    layer : HDF5DataLayer or MemoryDataLayer
        An open sync layer (``with layer:``); the caller opens and closes it.
    x : str, sequence of str, or mapping of str to str
        The model's inputs: a top's name, a tuple of them, or a dict of input names to tops.
    y : same as ``x``, optional
        The targets (none: ``x`` only, for a model whose loss needs no target).
    sample_weight : str, optional
        A top holding each sample's weight.

    Raises
    ------
    ConfigurationError
        A name that is not a top of the layer, or ``sample_weight`` without ``y``; at the
        first batch, a ragged or sparse top among them that no transformer made dense (Keras
        takes dense arrays: ``transforms.Pad(0, length=n)`` or ``transforms.Densify()``).

    Examples
    --------
    >>> import numpy as np
    >>> from asynchdf5 import MemoryDataLayer
    >>> from asynchdf5.keras import PyDataset
    >>> x, y = np.zeros((100, 3), np.float32), np.arange(100)
    >>> with MemoryDataLayer({"x": x, "y": y}, batch_size=32) as layer:
    ...     data = PyDataset(layer, x="x", y="y")
    ...     len(data)
    4
    """

    def __init__(
        self,
        layer: LayerBase,
        *,
        x: Tops,
        y: Tops | None = None,
        sample_weight: str | None = None,
    ) -> None:
        super().__init__(workers=1, use_multiprocessing=False)
        if sample_weight is not None and y is None:
            raise ConfigurationError("sample_weight needs y (Keras takes (x, y, sample_weight))")
        tops = set(layer.tops)
        for name in [*_names(x), *_names(y), *_names(sample_weight)]:
            if name not in tops:
                raise ConfigurationError(f"{name!r} is not a top of the layer (its tops: {tops})")
        self.layer = layer
        self.x, self.y, self.sample_weight = x, y, sample_weight
        #: The callback that tells this dataset which batches were trained on.
        self.position = Position(self)
        self._batches: Iterator[Batch] | None = None  # the layer's epoch in progress
        self._count = 0  # its batches this dataset has to serve (counted when it started)
        self._taken = 0  # ... taken from the layer so far
        self._served = 0  # ... served in Keras's current pass
        self._kept: list[tuple[Any, ...]] = []  # a look's first batches, to serve again
        self._replay: list[tuple[Any, ...]] = []  # ... served again, in order
        self._in_pass = False  # between Keras's on_epoch_begin and on_epoch_end
        self._in_keras_epoch = False  # in a training epoch (Position says): not a look
        self._states: dict[int, dict[str, Any]] = {}  # the layer's state after j batches
        self._trained = 0  # batches of the epoch trained on (Position says)
        self._tracked = False  # a Position callback is attached to the fit in progress
        self._resumed: tuple[int, int] | None = None  # (epoch, batches before) of a state loaded

    # --- what Keras calls ---------------------------------------------------------------------

    @property
    def num_batches(self) -> int:
        """The steps of the Keras epoch: the batches of the layer's epoch in progress, or of its
        next one (for an epoch resumed from a state, the batches after it)."""
        return self._count if self._batches is not None else len(self.layer)

    def __len__(self) -> int:
        return self.num_batches

    def on_epoch_begin(self) -> None:
        """A pass of Keras's over the epoch starts: the layer's epoch starts, or goes on (with
        the batches of an early-ended pass served again)."""
        if self._batches is None:
            self._count = len(self.layer)
            self._states = {0: self.layer.state_dict()}
            self._batches = iter(self.layer)
            self._taken = self._trained = 0
        self._served, self._kept, self._in_pass = 0, [], True

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        """The layer's next batch (whatever ``index``: the layer's order is the epoch's)."""
        if self._batches is None:
            raise StateError(
                "a batch was asked for outside an epoch: asynchdf5.keras.PyDataset serves "
                "model.fit (and evaluate/predict) only, in order, without a worker pool"
            )
        if self._served >= self._count:
            raise StateError(f"Keras asked for more than the epoch's {self._count} batches")
        if not self._in_keras_epoch and self._served >= _REPLAY:
            raise StateError(
                f"Keras asked for {_REPLAY + 1} batches outside a training epoch: pass the "
                "dataset's Position callback to fit (model.fit(data, callbacks=[data.position]))"
            )
        if self._replay:
            item = self._replay.pop(0)
        else:
            batch = next(self._batches)
            self._taken += 1
            self._states[self._taken] = self.layer.state_dict()
            item = self._item(batch)
        self._served += 1
        if len(self._kept) < _REPLAY and not self._in_keras_epoch:
            self._kept.append(item)
        return item

    def on_epoch_end(self) -> None:
        """Keras's pass ends: at the end of the layer's epoch, the epoch ends; after a look at
        its first batches, they are served again at the next pass."""
        served, kept = self._served, self._kept
        if not self._in_pass or self._batches is None:
            return  # Keras ends a pass twice when fit fails before its first epoch
        self._in_pass, self._kept = False, []
        if not self._in_keras_epoch:  # a look before training: nothing was trained on
            self._replay = kept[:served] + self._replay
            return
        batches, self._batches, self._replay = self._batches, None, []
        if served >= self._count:
            for _ in batches:  # the end: the layer counts the epoch as finished
                raise StateError("the layer's epoch has more batches than it said")
        else:  # left in its middle (stop_training, an error): the next pass starts afresh
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        self._states = {}
        self._trained = 0

    def _item(self, batch: Batch) -> tuple[Any, ...]:
        for name in [*_names(self.x), *_names(self.y), *_names(self.sample_weight)]:
            check_dense(name, batch[name], "asynchdf5.keras.PyDataset")
        x = _pick(batch, self.x)
        if self.y is None:
            return (x,)
        y = _pick(batch, self.y)
        if self.sample_weight is None:
            return (x, y)
        return (x, y, batch[self.sample_weight])

    # --- resume -------------------------------------------------------------------------------

    def _trained_on(self, n: int) -> None:
        """``n`` batches of the epoch were trained on (from :class:`Position`)."""
        self._trained = n
        for j in [j for j in self._states if j < n]:
            del self._states[j]

    def state_dict(self) -> dict[str, Any]:
        """Where training is: the layer's state after the batches trained on (plain values,
        JSON-ready), never counting those Keras fetched ahead. Take it in a callback or
        between fits.

        Raises
        ------
        StateError
            In an epoch whose fit has no :class:`Position` of this dataset among its
            callbacks (the trained batches are unknown).
        """
        if self._batches is None:
            return self.layer.state_dict()
        if not self._tracked:
            raise StateError(
                "state_dict() during an epoch needs the dataset's Position callback in fit: "
                "model.fit(data, callbacks=[data.position, ...])"
            )
        return self._states[self._trained]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`): the next batch served is the one
        that came next in the run that saved it. Call it between fits; then fit the rest of
        that epoch alone (``model.fit(data, initial_epoch=e, epochs=e + 1)``, with
        ``e = data.epoch``), because Keras counts the same steps in every epoch of a fit."""
        if self._batches is not None:
            raise StateError("load_state_dict during an epoch: call it between fits")
        self.layer.load_state_dict(state)
        before = batches_before(state)
        self._resumed = (self.layer.epoch, before) if before else None

    @property
    def epoch(self) -> int:
        """The layer's epoch in progress, or its next one: Keras's epoch number must be it."""
        return self.layer.epoch


class Position(keras.callbacks.Callback):  # type: ignore[misc]
    """The callback that tells a :class:`PyDataset` which batches the model was trained on.

    Pass it to ``fit`` (it is ``data.position``) before any callback that saves
    ``data.state_dict()``: after each batch, it says how many batches of the epoch were trained
    on. It also checks, at the start of ``fit`` and of each epoch, that Keras's epoch number is
    the layer's and that Keras's steps are the epoch's batches.

    Parameters
    ----------
    data : PyDataset
        The dataset given to ``fit``.
    """

    def __init__(self, data: PyDataset) -> None:
        super().__init__()
        self.data = data

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        data = self.data
        data._tracked = True
        epochs, resumed = self.params.get("epochs"), data._resumed
        if resumed is not None and resumed[0] == data.epoch and epochs > data.epoch + 1:
            raise StateError(
                f"this fit starts in the middle of epoch {data.epoch} (after {resumed[1]} of its "
                "batches), and Keras counts the same steps in every epoch of a fit: fit "
                f"that epoch's rest alone (model.fit(data, initial_epoch={data.epoch}, "
                f"epochs={data.epoch + 1})), then the next epochs in another fit"
            )

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.data._in_keras_epoch = True
        if epoch != self.data.epoch:
            raise StateError(
                f"Keras starts epoch {epoch}, but the layer's next epoch is {self.data.epoch}: "
                f"pass initial_epoch={self.data.epoch} to fit (one layer epoch per Keras epoch)"
            )

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.data._trained_on(batch + 1)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.data._in_keras_epoch = False

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        self.data._tracked = self.data._in_keras_epoch = False
