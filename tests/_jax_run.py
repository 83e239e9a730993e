"""JAX's side of ``test_jax``, run in a fresh interpreter with four virtual CPU devices
(``XLA_FLAGS`` must be set before JAX is imported): ``python -m tests._jax_run SOURCE``.

Checks (assertions: a failure exits non-zero): global arrays sharded over the four devices,
every sample once per epoch with data and labels aligned, fixed batch shapes, the named warning
where JAX would narrow int64 labels, and a resume from the state taken after batch k (with
batches on their way ahead) that yields exactly the uninterrupted run's batches k + 1, ..., and
the same global arrays from the per-top put of JAX before 0.7.1.
"""

from __future__ import annotations

import sys
import warnings

import jax
import numpy as np

import asynchdf5.jax as aj

BATCH = 8


def run(source: str) -> None:
    assert len(jax.devices()) == 4, jax.devices()
    with aj.layer(source, batch_size=BATCH, shuffle=True, seed=2) as lay:
        loader = aj.Loader(lay, prefetch=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            epochs = [[(b["label"], b["data"]) for b in loader] for _ in range(2)]
        named = [w for w in caught if issubclass(w.category, aj.NarrowingWarning)]
        assert len(named) == 1 and "'label'" in str(named[0].message), [str(w) for w in caught]
        n = 80 // BATCH  # drop_last: 80 samples, 10 whole batches
        for batches in epochs:
            assert len(batches) == n == len(loader)
            labels = np.concatenate([np.asarray(lab) for lab, _ in batches])
            assert sorted(labels.tolist()) == list(range(80))
            for lab, data in batches:
                assert lab.shape == (BATCH,) and data.shape == (BATCH, 2)
                assert lab.dtype == np.int32
                assert len(lab.sharding.device_set) == 4
                np.testing.assert_array_equal(np.asarray(data)[:, 0], np.asarray(lab) * 10)
        assert epochs[0][0][0].tolist() != epochs[1][0][0].tolist()  # a new order

    reference = [b[0].tolist() for b in epochs[0]] + [b[0].tolist() for b in epochs[1]]
    warnings.simplefilter("ignore", aj.NarrowingWarning)
    for k in (0, 3, 9):
        with aj.layer(source, batch_size=BATCH, shuffle=True, seed=2) as lay:
            loader = aj.Loader(lay, prefetch=3)
            for i, _ in enumerate(loader):
                if i == k:
                    state = loader.state_dict()
                    break
        with aj.layer(source, batch_size=BATCH, shuffle=True, seed=2) as lay:
            loader = aj.Loader(lay, prefetch=3)
            loader.load_state_dict(state)
            got = [b["label"].tolist() for _ in range(2) for b in loader]
        assert got == reference[k + 1 :], (k, got, reference)

    jax.config.update("jax_enable_x64", True)  # type: ignore[no-untyped-call]
    with aj.layer(source, batch_size=BATCH) as lay:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first = next(iter(aj.Loader(lay)))
        assert first["label"].dtype == np.int64
        # JAX before 0.7.1 takes one top per call: that path puts the same global arrays.
        aj._PUT_TAKES_TREES = False
        per_top = next(iter(aj.Loader(lay)))
    assert sorted(per_top) == sorted(first) == ["data", "label"]
    for name, a in per_top.items():
        assert a.sharding == first[name].sharding and a.dtype == first[name].dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(first[name]))
    print("ok")


if __name__ == "__main__":
    run(sys.argv[1])
