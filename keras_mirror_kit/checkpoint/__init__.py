"""Checkpoints: the files, their directory, and what a training state is made of.

Keras' `BackupAndRestore` writes its files in place (a kill during a write destroys the
only backup), lets every worker write the same path, replays an interrupted epoch on
already-trained weights when `save_freq` is an integer, and never resets
`model._initial_epoch` (a later `fit` on the same model silently skips epochs).
`SyncedCheckpoint` and the modules here have none of these faults.

The modules, from the bottom up (each imports only those below it):

* `fit_record`: which `fit()` of a script a checkpoint belongs to (`FitRecord`, what a
  process numbers its own `fit()` calls by, and `place`: what a starting `fit()` does with
  another's checkpoint).
* `meta`: the one schema of a checkpoint's metadata and of the manifest's entries.
* `store` (the directory of verified, atomically written `.npz` files, its manifest and
  retention; the error and warning classes), `lock` (one writer per directory) and
  `best` (`keep_best`'s scores and ranking): NumPy and the standard library only, so
  `keras-mirror-kit ckpt ls|verify` start without TensorFlow.
* `state` (the variables a checkpoint holds, paired by path and applied),
  `callback_state` (the other callbacks' saved state), `snapshot` (reading the state for
  a save; the background writer), `divergence` (the replica check before a save),
  `preemption` (saving on a stop signal), `optimizer_match` (whether a checkpoint's
  optimizer state is this `fit()`'s optimizer's, across a recompile).
* `resume` (which checkpoint a `fit()` goes on from, and where) and `restore`
  (`kmk.restore` and export, outside `fit`).

What differs between Keras backends (reading a variable, the finite check, the replicas'
copies) is asked of `keras_mirror_kit.backends.current()`; the files are the same on every
backend, and a checkpoint restores on the other one where the variables match.

`keras_mirror_kit.callbacks.SyncedCheckpoint` drives them through a `fit()`; nothing here
imports the callbacks. This package imports none of its modules itself (importing it
costs nothing).
"""
