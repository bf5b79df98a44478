"""The one seam to Keras' and TensorFlow's internals, and the versions the kit was tested on.

Every private symbol of Keras (`keras.src`) or TensorFlow (`tensorflow.python`,
`tf.__internal__`) that the kit reads, wraps or patches is resolved here, for every
supported version, and nowhere else (`tests/test_upstream_seam.py` says so). When Keras
renames or moves one (Keras 3.16 renamed `trainers.trainer.Trainer` to `BaseTrainer`), one
function here changes and the rest of the kit does not.

* `keras_mirror_kit.upstream.versions`: the installed and the tested versions, and the one
  notice for a version outside the tested range.
* `keras_mirror_kit.upstream.keras_private`: Keras' private classes, modules and functions.
* `keras_mirror_kit.upstream.tensorflow_private`: TensorFlow's.

Each resolver imports lazily (the kit imports without TensorFlow or Keras loaded) and
raises `ImportError` naming the installed version when a symbol is on none of the layouts
it knows; the workaround that needs it then refuses its feature
(`keras_mirror_kit.workarounds.KerasPatch`).
"""

from __future__ import annotations

from keras_mirror_kit.upstream import keras_private, tensorflow_private, versions

__all__ = ["keras_private", "tensorflow_private", "versions"]
