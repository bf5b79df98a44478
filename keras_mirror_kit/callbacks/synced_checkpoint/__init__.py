"""`SyncedCheckpoint`: crash-safe, replica-verified, resumable checkpoints for `model.fit`.

Keras' `BackupAndRestore` writes its files in place (a kill during a write destroys the
only backup), lets every worker write the same path, replays an interrupted epoch on
already-trained weights when `save_freq` is an integer, and never resets
`model._initial_epoch` (a later `fit` on the same model silently skips epochs). This
callback has none of these faults; the file format and its guarantees live in
`keras_mirror_kit.checkpoint_store`.

Modules: `callback` (the callback and its course through a `fit()`), `hooks` (its place in
the `CallbackList`), `callback_state` (the other callbacks' saved state), `state` (the
variables saved and restored), `resume` (which checkpoint, and where a `fit()` goes on),
`replicas` (the replica check, `ReplicaDivergenceError`), `preemption` (saving on a stop
signal, `Preempted`).
"""

from keras_mirror_kit.callbacks.synced_checkpoint.callback import SyncedCheckpoint
from keras_mirror_kit.callbacks.synced_checkpoint.preemption import PREEMPTED_EXIT_CODE, Preempted
from keras_mirror_kit.callbacks.synced_checkpoint.replicas import ReplicaDivergenceError

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "ReplicaDivergenceError", "SyncedCheckpoint"]
