"""Tests of the built-in transformers in asynchdf5.transforms."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from asynchdf5 import transforms as T
from asynchdf5._errors import ConfigurationError, SchemaError, SourceError

RNG = np.random.default_rng(0)
IMAGES = RNG.integers(0, 256, size=(4, 5, 6, 3), dtype=np.uint8)  # NHWC
CHANNEL_MEAN = np.array([10.0, 20.0, 30.0])
CHANNEL_STD = np.array([2.0, 4.0, 8.0])


def write_mean(path: Path, name: str = "mean", value: Any = CHANNEL_MEAN) -> Path:
    with h5py.File(path, "w") as f:
        f[name] = value
    return path


# -- values and dtypes ------------------------------------------------------------------------


def test_scale_values_and_float32_for_uint8() -> None:
    out = T.Scale(1 / 255)(IMAGES)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, IMAGES.astype(np.float64) / 255, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_floating_input_keeps_dtype(dtype: type[np.floating[Any]]) -> None:
    x = IMAGES.astype(dtype)
    for transform in (
        T.Scale(0.5),
        T.SubMean(mean=CHANNEL_MEAN),
        T.Normalize(CHANNEL_MEAN, CHANNEL_STD),
    ):
        assert transform(x).dtype == dtype, transform


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.int64, np.uint16])
def test_integer_and_bool_input_give_float32(dtype: type[np.generic]) -> None:
    x = IMAGES.astype(dtype)
    for transform in (
        T.Scale(2.0),
        T.SubMean(mean=CHANNEL_MEAN),
        T.Normalize(CHANNEL_MEAN, CHANNEL_STD),
    ):
        assert transform(x).dtype == np.float32, transform


def test_submean_values_per_channel_and_full_shape() -> None:
    expected = IMAGES.astype(np.float64) - CHANNEL_MEAN
    np.testing.assert_allclose(T.SubMean(mean=CHANNEL_MEAN)(IMAGES), expected, rtol=1e-6)
    full = RNG.random(IMAGES.shape[1:]) * 255
    np.testing.assert_allclose(
        T.SubMean(mean=full)(IMAGES), IMAGES.astype(np.float64) - full, rtol=1e-5, atol=1e-4
    )


def test_normalize_values() -> None:
    x = IMAGES.astype(np.float64)
    out = T.Normalize(mean=CHANNEL_MEAN, std=CHANNEL_STD)(x)
    np.testing.assert_allclose(out, (x - CHANNEL_MEAN) / CHANNEL_STD)


def test_constant_transforms_do_not_modify_input() -> None:
    x = IMAGES.astype(np.float32)
    before = x.copy()
    for transform in (
        T.Scale(3.0),
        T.SubMean(mean=CHANNEL_MEAN),
        T.Normalize(CHANNEL_MEAN, CHANNEL_STD),
    ):
        assert transform(x) is not x
    np.testing.assert_array_equal(x, before)


def test_constant_that_does_not_fit_the_sample_shape() -> None:
    with pytest.raises(ValueError, match="does not broadcast"):
        T.SubMean(mean=np.zeros(4))(IMAGES)
    # Broadcasting over the batch axis would silently give a wrong result: refused too.
    with pytest.raises(ValueError, match="does not broadcast"):
        T.SubMean(mean=np.zeros((4, 5, 6, 3)))(IMAGES)
    # A mean that would enlarge the samples is refused rather than changing the sample shape.
    with pytest.raises(ValueError, match="does not broadcast"):
        T.Normalize(np.zeros(3), np.ones(3))(np.zeros((2, 1)))


def test_cast() -> None:
    out = T.Cast("float16")(IMAGES)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, IMAGES)
    # No needless copy when the batch already has the dtype.
    assert T.Cast(np.uint8)(IMAGES) is IMAGES


def test_transpose_shape_values_and_contiguity() -> None:
    out = T.Transpose((2, 0, 1))(IMAGES)
    assert out.shape == (4, 3, 5, 6)
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out, IMAGES.transpose(0, 3, 1, 2))


def test_transpose_wrong_sample_ndim() -> None:
    with pytest.raises(ValueError, match=r"Transpose\(\(1, 0\)\) needs samples with 2 axes"):
        T.Transpose((1, 0))(IMAGES)


# -- SubMean from an HDF5 mean file -------------------------------------------------------------


def test_submean_from_file(tmp_path: Path) -> None:
    path = write_mean(tmp_path / "mean.h5")
    transform = T.SubMean(mean_file=path)
    expected = IMAGES.astype(np.float64) - CHANNEL_MEAN
    np.testing.assert_allclose(transform(IMAGES), expected, rtol=1e-6)
    path.unlink()  # loaded once, on the first call
    np.testing.assert_allclose(transform(IMAGES), expected, rtol=1e-6)


def test_submean_file_loaded_once_across_threads(tmp_path: Path) -> None:
    transform = T.SubMean(mean_file=write_mean(tmp_path / "mean.h5"))
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: transform(IMAGES), range(16)))
    for out in outs:
        np.testing.assert_array_equal(out, outs[0])


def test_submean_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.h5"
    with pytest.raises(SourceError, match=r"nope\.h5"):
        T.SubMean(mean_file=path)


def test_submean_file_without_mean_dataset(tmp_path: Path) -> None:
    path = write_mean(tmp_path / "other.h5", name="average")
    transform = T.SubMean(mean_file=str(path))  # construction does not read the file
    with pytest.raises(SchemaError, match=r"other\.h5.*'mean'"):
        transform(IMAGES)


def test_submean_file_not_hdf5(tmp_path: Path) -> None:
    path = tmp_path / "mean.h5"
    path.write_text("not HDF5")
    transform = T.SubMean(mean_file=path)
    with pytest.raises(SourceError, match=r"mean\.h5"):
        transform(IMAGES)


def test_submean_file_with_non_numeric_mean(tmp_path: Path) -> None:
    path = write_mean(tmp_path / "mean.h5", value="abc")
    with pytest.raises(SchemaError, match="not numeric"):
        T.SubMean(mean_file=path)(IMAGES)


def test_importing_does_not_import_cupy() -> None:
    code = "import sys, asynchdf5.transforms; print('cupy' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert done.stdout.strip() == "False"


# -- construction errors and repr ---------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: T.Scale("big"),  # type: ignore[arg-type]
        lambda: T.Scale(float("nan")),
        lambda: T.Scale(float("inf")),
        lambda: T.SubMean(),
        lambda: T.SubMean(mean=CHANNEL_MEAN, mean_file="mean.h5"),
        lambda: T.SubMean(mean="abc"),
        lambda: T.Normalize(CHANNEL_MEAN, [1.0, 0.0, 1.0]),
        lambda: T.Normalize(CHANNEL_MEAN, [1.0, -1.0, 1.0]),
        lambda: T.Normalize(CHANNEL_MEAN, [1.0, float("nan"), 1.0]),
        lambda: T.Normalize(CHANNEL_MEAN, [1.0, 2.0]),
        lambda: T.Normalize("abc", 1.0),
        lambda: T.Cast("float33"),
        lambda: T.Cast(None),  # type: ignore[arg-type]
        lambda: T.Transpose((0, 2)),
        lambda: T.Transpose((0, 0, 1)),
        lambda: T.Transpose((1.0, 0.0)),  # type: ignore[arg-type]
        lambda: T.Transpose(3),  # type: ignore[arg-type]
    ],
)
def test_construction_errors(make: Any) -> None:
    with pytest.raises(ConfigurationError):
        make()


def test_configuration_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        T.Cast("float33")


def test_repr(tmp_path: Path) -> None:
    path = write_mean(tmp_path / "mean.h5")
    assert repr(T.Scale(1 / 255)) == "Scale(0.00392157)"
    assert repr(T.SubMean(mean=[1, 2, 3])) == "SubMean(mean=[1.0, 2.0, 3.0])"
    assert repr(T.SubMean(mean=np.zeros((3, 8, 8)))) == "SubMean(mean=<array of shape (3, 8, 8)>)"
    assert repr(T.SubMean(mean_file=path)) == f"SubMean(mean_file={str(path)!r})"
    assert repr(T.Normalize(0.5, 0.25)) == "Normalize(mean=0.5, std=0.25)"
    assert repr(T.Cast(np.float32)) == "Cast('float32')"
    assert repr(T.Transpose([2, 0, 1])) == "Transpose((2, 0, 1))"


# -- CuPy ---------------------------------------------------------------------------------------


@pytest.fixture
def cupy(cupy_gpu: Any) -> Any:
    return cupy_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float32, np.float64])
def test_cupy_matches_numpy(cupy: Any, dtype: type[np.generic]) -> None:
    x = IMAGES.astype(dtype)
    x_gpu = cupy.asarray(x)
    for transform in (
        T.Scale(1 / 255),
        T.SubMean(mean=CHANNEL_MEAN),
        T.SubMean(mean=cupy.asarray(CHANNEL_MEAN)),
        T.Normalize(CHANNEL_MEAN, CHANNEL_STD),
        T.Cast(np.float32),
        T.Transpose((2, 0, 1)),
    ):
        expected = transform(x)
        for _ in range(2):  # the second call uses the cached device constants
            out = transform(x_gpu)
            assert isinstance(out, cupy.ndarray), transform
            assert out.dtype == expected.dtype, transform
            assert out.shape == expected.shape, transform
            assert out.flags.c_contiguous, transform
            tol = 1e-2 if dtype == np.float16 else 1e-6
            np.testing.assert_allclose(cupy.asnumpy(out), expected, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_cupy_submean_from_file(cupy: Any, tmp_path: Path) -> None:
    transform = T.SubMean(mean_file=write_mean(tmp_path / "mean.h5"))
    out = transform(cupy.asarray(IMAGES))
    np.testing.assert_allclose(cupy.asnumpy(out), transform(IMAGES), rtol=1e-6)
