"""`DatasetCursor`: where the next iteration of a kit dataset starts (epoch, batch, seed)."""

from __future__ import annotations

import tensorflow as tf

from keras_mirror_kit.validation import non_negative_int

__all__ = ["DatasetCursor"]

_EPOCH, _SKIP, _SEED = 0, 1, 2


class DatasetCursor:
    """Where the next iteration of a `make_dataset` dataset starts: epoch and batch.

    Each new iterator over the dataset reads the cursor once, when its first batch is
    requested: it uses the permutation of `epoch`, starts after `skip_batches` batches, and
    then moves the cursor to the next epoch with no skip. Set it before an epoch begins to
    choose the order and start of that epoch.

    The dataset's length stays `num_batches` (Keras needs a known epoch length), so an
    iteration that skipped `k` batches and is read to its end wraps around to the epoch's
    first `k` batches. `SyncedCheckpoint` ends a resumed epoch after its remaining batches,
    so nothing is trained twice.

    The shuffle seed lives in the cursor too, so that a resumed run can shuffle exactly as
    the interrupted one did even when that one drew its seed at random.

    Args:
        num_batches: Batches in one full epoch.
        seed: The shuffle seed.
        seed_given: Whether the user chose the seed (False: drawn at random).
        num_samples: Samples the epoch's order is a permutation of, or None when unknown
            (a resume compares it with the checkpoint's).

    Example:

    ```python
    cursor = kmk.cursor_of(train_ds)
    cursor.set(epoch=3, skip_batches=10)   # next epoch: order of epoch 3, from batch 10
    ```
    """

    def __init__(
        self,
        num_batches: int,
        seed: int = 0,
        seed_given: bool = True,
        num_samples: int | None = None,
    ) -> None:
        self.num_batches = num_batches
        self.num_samples = num_samples
        self.seed_given = seed_given
        # A lookup table, not a tf.Variable: a table is not mirrored when the dataset is
        # made inside a strategy's scope, and it is read on the host by the input pipeline.
        with tf.device("/cpu:0"):
            self._table = tf.lookup.experimental.MutableHashTable(
                key_dtype=tf.int64, value_dtype=tf.int64, default_value=0
            )
        self.set_seed(seed)

    @property
    def seed(self) -> int:
        """The shuffle seed the next iteration uses."""
        return int(self._table.lookup(tf.constant([_SEED], tf.int64)).numpy()[0])

    def set_seed(self, seed: int) -> None:
        """Replaces the shuffle seed (a resume uses the interrupted run's).

        Args:
            seed: A non-negative integer.

        Returns:
            None.

        Raises:
            ValueError: If `seed` is negative or not an integer.

        Example:

        ```python
        cursor.set_seed(1234)
        ```
        """
        non_negative_int("seed", seed)
        self._table.insert(tf.constant([_SEED], tf.int64), tf.constant([int(seed)], tf.int64))

    def set(self, epoch: int, skip_batches: int = 0) -> None:
        """Sets the epoch whose order the next iteration uses, and batches to skip.

        Args:
            epoch: Epoch number (keys the shuffle permutation); >= 0.
            skip_batches: Batches of that epoch already consumed; 0 <= skip < num_batches.

        Returns:
            None.

        Raises:
            ValueError: On a negative epoch or a skip outside the epoch.

        Example:

        ```python
        cursor.set(epoch=2)
        ```
        """
        epoch = non_negative_int("epoch", epoch)
        if not 0 <= skip_batches < max(1, self.num_batches):
            raise ValueError(
                f"`skip_batches` must be in [0, {self.num_batches}). "
                f"Received: skip_batches={skip_batches}"
            )
        self._table.insert(
            tf.constant([_EPOCH, _SKIP], tf.int64),
            tf.constant([int(epoch), int(skip_batches)], tf.int64),
        )

    def get(self) -> tuple[int, int]:
        """Returns `(epoch, skip_batches)` that the next iteration will use.

        Returns:
            A pair of ints.

        Example:

        ```python
        epoch, skip = cursor.get()
        ```
        """
        values = self._table.lookup(tf.constant([_EPOCH, _SKIP], tf.int64)).numpy()
        return int(values[0]), int(values[1])

    def _take(self) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """Reads epoch, skip and seed and advances to the next epoch (in the input pipeline)."""
        keys = tf.constant([_EPOCH, _SKIP], tf.int64)
        values = self._table.lookup(keys)
        seed = self._table.lookup(tf.constant([_SEED], tf.int64))[0]
        with tf.control_dependencies([values, seed]):
            update = self._table.insert(keys, tf.stack([values[0] + 1, tf.constant(0, tf.int64)]))
        with tf.control_dependencies([update]):
            return tf.identity(values[0]), tf.identity(values[1]), tf.identity(seed)
