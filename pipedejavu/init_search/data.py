"""The bundled handwritten digits and their fixed train/validation/test split.

``pipedejavu/data/digits.npz`` is scikit-learn's copy of the UCI optical digits
test set (1,797 8x8 images, 10 classes; see ``pipedejavu/data/DIGITS.md``). The
split is fixed (one permutation drawn with a constant seed), so every strategy
and every run sees the same three parts: candidates train on ``train``, are
scored and picked on ``validation``, and the final numbers are reported on
``test`` as well, which no choice ever looks at.
"""

from __future__ import annotations

import importlib.resources
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.npzfile import read_npz
from pipedejavu.core.problem import ProblemError

__all__ = ["Dataset", "Split", "load_digits", "split_dataset"]

#: Seed of the one permutation that defines the split (a constant of the data set).
SPLIT_SEED = 20261123
NUM_PIXELS, NUM_CLASSES, NUM_IMAGES = 64, 10, 1797
# The images take 115,008 bytes (+ the .npy header): room to spare, no more.
_MAX_ARRAY_BYTES = 1 << 20
# What read_npz may read: two such arrays, each element counted as 8 bytes.
_MAX_READ_BYTES = 2 * 8 * _MAX_ARRAY_BYTES


class Split(NamedTuple):
    """One part of the data set.

    Attributes:
        inputs: f32[n, 64] pixel counts scaled to [0, 1].
        labels: i32[n] digits 0..9.
    """

    inputs: NDArray[np.float32]
    labels: NDArray[np.int32]


class Dataset(NamedTuple):
    """The three disjoint parts of the data set."""

    train: Split
    validation: Split
    test: Split

    @property
    def num_classes(self) -> int:
        """Classes of the labels (10 digits)."""
        return NUM_CLASSES


def _read(path: Path | str) -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    """The images and labels of a digits ``.npz``, checked: the zip directory
    first (the two arrays, each small), then the arrays through
    :func:`~pipedejavu.core.npzfile.read_npz` (no pickles, headers checked
    against the entries, CRC and decompression errors reported)."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except Exception as error:  # untrusted input: report, never crash
        detail = " ".join(str(error).split())[:160] or type(error).__name__
        raise ProblemError(f"{path}: not a readable digits .npz ({detail})") from None
    names = sorted(info.filename.removesuffix(".npy") for info in infos)
    if names != ["images", "labels"]:
        raise ProblemError(
            f"{path}: expected the arrays 'images' and 'labels', got {names}"
        )
    largest = max(info.file_size for info in infos)
    if largest > _MAX_ARRAY_BYTES:
        raise ProblemError(
            f"{path}: holds a {largest}-byte array; the digits need at most "
            f"{_MAX_ARRAY_BYTES} bytes per array"
        )
    arrays = read_npz(
        path,
        required=("images", "labels"),
        what="a digits .npz",
        max_bytes=_MAX_READ_BYTES,
    )
    images, labels = arrays["images"], arrays["labels"]
    if images.dtype != np.uint8 or images.shape != (NUM_IMAGES, 8, 8):
        raise ProblemError(
            f"{path}: images must be uint8 [{NUM_IMAGES}, 8, 8], "
            f"got {images.dtype} {list(images.shape)}"
        )
    if labels.dtype != np.uint8 or labels.shape != (NUM_IMAGES,):
        raise ProblemError(
            f"{path}: labels must be uint8 [{NUM_IMAGES}], "
            f"got {labels.dtype} {list(labels.shape)}"
        )
    if images.max() > 16 or labels.max() >= NUM_CLASSES:
        raise ProblemError(f"{path}: pixels must lie in 0..16 and labels in 0..9")
    return images, labels


def split_dataset(
    images: NDArray, labels: NDArray, *, fractions: tuple[float, float] = (0.2, 0.2)
) -> Dataset:
    """Split into train / validation / test with the fixed permutation.

    Args:
        images: u8[n, 8, 8] pixel counts 0..16.
        labels: u8[n] digits.
        fractions: (validation, test) shares of the n images.

    Returns:
        The three parts; inputs flattened to 64 and divided by 16.
    """
    validation_share, test_share = fractions
    if not (
        0 < validation_share and 0 < test_share and validation_share + test_share < 1
    ):
        raise ValueError(
            f"fractions must be two positive shares summing below 1, got {fractions}"
        )
    count = len(labels)
    order = np.random.default_rng(SPLIT_SEED).permutation(count)
    num_validation = round(validation_share * count)
    num_test = round(test_share * count)
    parts = np.split(order, [num_validation, num_validation + num_test])
    inputs = images.reshape(count, -1).astype(np.float32) / 16.0
    targets = labels.astype(np.int32)
    validation, test, train = (Split(inputs[p], targets[p]) for p in parts)
    return Dataset(train=train, validation=validation, test=test)


def load_digits(path: Path | str | None = None) -> Dataset:
    """The bundled digits (or a file of the same layout), split.

    Args:
        path: a ``.npz`` with ``images`` u8[1797, 8, 8] and ``labels`` u8[1797];
            None: the copy inside the package.

    Returns:
        1,079 training, 359 validation and 359 test images.

    Raises:
        ProblemError: the file is missing, unreadable or has the wrong layout.
    """
    if path is None:
        path = importlib.resources.files("pipedejavu").joinpath("data", "digits.npz")
    images, labels = _read(path)
    return split_dataset(images, labels)
