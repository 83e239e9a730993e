"""Keras's side of ``test_keras``, run in a fresh interpreter whose ``KERAS_BACKEND`` was set
before Keras is imported: ``python -m tests._keras_train SOURCE FOLDER SAVED``.

Trains a small model for two epochs on the source through :class:`asynchdf5.keras.PyDataset`,
uninterrupted; then again, saving the model and the loader's state after global step ``SAVED``
and crashing three steps later; then resumes from what was saved. Checks (assertions: a failure
exits non-zero) that the state after every trained batch is the uninterrupted run's, that the
state after ``k`` batches is the one a plain layer has after handing over ``k`` (no batch Keras
read ahead counts), that each epoch trained on every sample once, and that the resumed model
ends with the uninterrupted one's weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np

from asynchdf5 import HDF5DataLayer, StateError
from asynchdf5.keras import PyDataset

EPOCHS = 2
BATCH = 8


class Crash(RuntimeError):
    """The job dies."""


class Record(keras.callbacks.Callback):  # type: ignore[misc]
    """After each trained batch: the loader's state; at ``save``, the model and the state
    saved; at ``crash``, an exception."""

    def __init__(
        self, data: PyDataset, folder: Path, save: int | None = None, crash: int | None = None
    ) -> None:
        super().__init__()
        self.data, self.folder, self.save, self.crash = data, folder, save, crash
        self.states: list[dict[str, Any]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        state = self.data.state_dict()
        self.states.append(state)
        step = len(self.states)
        if step == self.save:
            self.model.save(self.folder / "model.keras")
            (self.folder / "loader.json").write_text(json.dumps(state))
        if step == self.crash:
            raise Crash(f"after step {step}")


class Seen(PyDataset):
    """The dataset, noting the labels of each batch served in a training epoch (by epoch)."""

    def __init__(self, layer: HDF5DataLayer) -> None:
        super().__init__(layer, x="data", y="label")
        self.seen: dict[int, list[int]] = {}

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        item = super().__getitem__(index)
        if self._in_keras_epoch:
            self.seen.setdefault(self.epoch, []).extend(int(v) for v in item[1])
        return item


def layer(source: str) -> HDF5DataLayer:
    return HDF5DataLayer(source, batch_size=BATCH, shuffle=True, seed=3)


def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.SGD(1e-6), loss="mse")
    return m


def fit(m: keras.Model, data: PyDataset, record: Record, first: int, last: int) -> None:
    m.fit(
        data,
        initial_epoch=first,
        epochs=last,
        callbacks=[data.position, record],
        verbose=0,
    )


def main(source: str, folder: Path, saved: int) -> None:
    with layer(source) as plain:  # the states after k batches handed over, without Keras
        expected = []
        for _ in range(EPOCHS):
            for _batch in plain:
                expected.append(plain.state_dict())

    whole = model()
    with layer(source) as lay:
        data = Seen(lay)
        per_epoch = len(data)
        reference = Record(data, folder)
        fit(whole, data, reference, 0, EPOCHS)
        samples = lay.n_samples
    assert len(reference.states) == EPOCHS * per_epoch
    # Two Keras epochs trained on two epochs of data: every sample once in each.
    assert sorted(data.seen) == list(range(EPOCHS)), data.seen.keys()
    for labels in data.seen.values():
        assert sorted(labels) == list(range(samples)), labels
    assert reference.states == expected, "the states are not the batches trained on"

    with layer(source) as lay:
        data = PyDataset(lay, x="data", y="label")
        crashed = Record(data, folder, save=saved, crash=saved + 3)
        try:
            fit(model(), data, crashed, 0, EPOCHS)
        except Crash:
            pass
        else:
            raise AssertionError("no crash")
    assert crashed.states == reference.states[: saved + 3]

    resumed_model = keras.models.load_model(folder / "model.keras")
    with layer(source) as lay:
        data = PyDataset(lay, x="data", y="label")
        data.load_state_dict(json.loads((folder / "loader.json").read_text()))
        resumed = Record(data, folder)
        e = data.epoch
        if e + 1 < EPOCHS:  # one fit over the rest of this epoch and the next: refused
            try:
                fit(resumed_model, data, resumed, e, EPOCHS)
            except StateError as exc:
                assert "rest alone" in str(exc), exc
            else:
                raise AssertionError("a fit with the wrong steps per epoch was not refused")
            assert resumed.states == []
        fit(resumed_model, data, resumed, e, e + 1)  # the rest of the epoch saved in
        if e + 1 < EPOCHS:
            fit(resumed_model, data, resumed, e + 1, EPOCHS)
    # "samples" counts the samples handed over since the layer started (fewer after a resume).
    got = [{k: v for k, v in s.items() if k != "samples"} for s in resumed.states]
    want = [{k: v for k, v in s.items() if k != "samples"} for s in reference.states[saved:]]
    assert got == want, "the resumed run did not go on where the saved one was"
    for a, b in zip(whole.get_weights(), resumed_model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    print("ok", keras.backend.backend())


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
