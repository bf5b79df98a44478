"""Models that write their own training step train and resume like one device (issue:
"Models that write their own training step").

The keras-io VAE, DCGAN (with and without a `call()`), conditional GAN, WGAN-GP (with
Adam: see `WITH_SGD`) and Distiller, the Keras guide's `CustomModel` variants and GAN
(`tests/own_step_models.py`, their authors' step code on small networks), and a step
written each of the other ways a loss is written (`LossForms`), each built in a kit
factory with the same first weights on 1 and on 2 replicas of this process: every
variable of the model, of every optimizer it holds and of its own seed generator, and
every figure `fit` logs, agree to 1e-6, with Adam on 29 rows (a last batch of 5, split
3/2) and, for one model of each kind, with SGD on 32 (even). A loss written for another
replica count is refused before any step; a killed GAN resumes bit for bit; state no
checkpoint holds is named (a stateful random op refused) before any step; `doctor
--model` names the own step (`@slow`: a child process).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror_kit as kmk
from keras_mirror_kit.checkpoint.state import state_variables
from keras_mirror_kit.checkpoint.store import CheckpointError
from keras_mirror_kit.model_parts import metrics_of, optimizers_of, untracked_variables
from keras_mirror_kit.replica_check.causes import model_causes
from keras_mirror_kit.workarounds import keras_activity_regularizer_sum
from tests import forkserver
from tests import own_step_models as models
from tests.ckpt_helpers import StopAt
from tests.subproc import REPO

pytestmark = pytest.mark.slow  # every test here trains models on 1 and 2 replicas (seconds each)

ONE, TWO = ["/cpu:0"], ["/cpu:0", "/cpu:1"]
TOLERANCE = 1e-6
BATCH = models.GLOBAL_BATCH
EXACT = (
    "vae",
    "dcgan",
    "dcgan_call",
    "cgan",
    "distiller",
    "guide1",
    "guide2",
    "guide3",
    "guide_gan",
    "wgan",
    "form:mean",
    "form:sum_over_rows",
    "form:compute_average_loss",
    "form:compute_average_loss_global",
    "form:add_loss",
    "counting",
)


def _state(model: keras.Model, metrics: bool = True) -> list[np.ndarray]:
    """Every variable a checkpoint holds: the model's, every optimizer's, the own seed's and
    (with `metrics`) the metrics' sums."""
    named = state_variables(model)
    return [np.array(v.numpy()) for group, v in named if metrics or group != "metrics"]


def _gap(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(
        float(np.max(np.abs(x.astype("float64") - y.astype("float64")))) if x.size else 0.0
        for x, y in zip(a, b, strict=True)
    )


def _trained(name: str, devices: list[str], optimizer: str, rows: int):
    model = models.build(name, devices, optimizer)
    history = model.fit(
        *models.data(name, rows), batch_size=BATCH, epochs=2, shuffle=False, verbose=0
    )
    return model, history.history


# Adam on an uneven split for every step; SGD on an even one too for one model of each kind
# (a loss of its own, two optimizers with Keras' Loss objects and keras.random draws).
# keras-io's WGAN-GP (2 critic steps a step, each with a gradient penalty: a nested tape)
# took other weights from run to run on 2 replicas, with SGD mostly, until the updates were
# ordered after every gradient of their application (workarounds.tf_grappler_update_order).
WITH_SGD = ("vae", "dcgan", "guide_gan", "wgan")


@pytest.mark.parametrize("name", EXACT)
def test_one_and_two_replicas_train_alike_and_log_alike(name: str) -> None:
    if name == "form:add_loss" and keras_activity_regularizer_sum.sums_over_the_batch():
        with pytest.raises(ValueError, match="activity_regularizer"):  # Keras before 3.14
            models.build(name, TWO, "adam")
        return
    runs = (("adam", 29), ("sgd", 32)) if name in WITH_SGD else (("adam", 29),)
    for optimizer, rows in runs:
        one, one_logs = _trained(name, ONE, optimizer, rows)
        two, two_logs = _trained(name, TWO, optimizer, rows)
        gap = _gap(_state(one, metrics=False), _state(two, metrics=False))
        assert gap <= TOLERANCE, (name, optimizer, rows, gap)  # the metrics: in the logs
        assert set(one_logs) == set(two_logs), (one_logs, two_logs)
        for key in one_logs:
            assert np.allclose(one_logs[key], two_logs[key], rtol=TOLERANCE, atol=TOLERANCE), (
                name,
                optimizer,
                key,
                one_logs[key],
                two_logs[key],
            )
        assert int(two.optimizer.iterations.numpy()) in (0, 8)  # 4 steps x 2 epochs, or unused


def _flat_logs(logs: dict) -> dict:
    """`logs` with nested dicts (a `CompileMetrics`' result) flattened, values as floats."""
    flat = {}
    for key, value in logs.items():
        flat.update(_flat_logs(value) if isinstance(value, dict) else {key: float(value)})
    return flat


def test_a_sum_metric_counts_one_devices_batches_and_a_test_step_alone_trains_once() -> None:
    for devices in (ONE, TWO):
        counting, logs = _trained("counting", devices, "sgd", 32)
        assert logs["batches"] == [4.0, 4.0], (len(devices), logs)  # read outside the step
        assert float(counting.batches.result()) == 4.0
    # A model with its own test_step only: Keras' train_step trains it, one update a step
    # (the probe is for own train_steps), and evaluate logs one device's figures.
    runs = []
    for devices in (ONE, TWO):
        guide, logs = _trained("guide4", devices, "sgd", 29)
        assert int(guide.optimizer.iterations.numpy()) == 8
        logs = guide.evaluate(*models.data("guide4", 29), return_dict=True, verbose=0)
        runs.append(_flat_logs(logs))  # Keras before 3.15 returns them nested, as tensors
    assert runs[0].keys() == runs[1].keys()
    assert all(np.isclose(runs[0][k], runs[1][k], rtol=TOLERANCE) for k in runs[0]), runs


def test_every_optimizer_the_model_holds_trains_and_is_saved() -> None:
    gan, _ = _trained("dcgan", TWO, "adam", 32)
    held = optimizers_of(gan)
    assert held[0] is gan.optimizer and {id(gan.d_optimizer), id(gan.g_optimizer)} <= {
        id(o) for o in held
    }
    assert int(gan.d_optimizer.iterations.numpy()) == int(gan.g_optimizer.iterations.numpy()) == 8
    saved = {id(v) for _, v in state_variables(gan)}
    assert all(id(v) in saved for v in gan.d_optimizer.variables + gan.g_optimizer.variables)
    # The GAN's metrics property first, then what it holds (Keras' own unused loss tracker).
    assert [m.name for m in metrics_of(gan)] == ["d_loss", "g_loss", "loss"]


@pytest.mark.parametrize("form", ["sum_over_global", "over_replicas"])
def test_a_loss_reduced_for_another_replica_count_is_refused_before_any_step(form: str) -> None:
    model = models.build(f"form:{form}", TWO)
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"was 1/2 of one device's") as raised:
        model.fit(*models.data("form:mean", 32), batch_size=BATCH, epochs=1, verbose=0)
    assert "keras.ops.mean" in str(raised.value) and "Nothing was trained" in str(raised.value)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert _gap(before, model.get_weights()) == 0.0
    # On one replica the same step is one device's: nothing to refuse.
    alone = models.build(f"form:{form}", ONE)
    alone.fit(*models.data("form:mean", 32), batch_size=BATCH, epochs=1, verbose=0)
    assert int(alone.optimizer.iterations.numpy()) == 4


@pytest.mark.parametrize("name", ["dcgan", "wgan"])
def test_a_killed_gan_resumes_on_the_uninterrupted_state_bit_for_bit(
    name: str, tmp_path: Path
) -> None:
    data = models.data(name, 32)

    def fit(model: keras.Model, directory: str, *extra: keras.callbacks.Callback) -> Any:
        return model.fit(
            *data,
            batch_size=BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[kmk.SyncedCheckpoint(tmp_path / directory, save_freq=1), *extra],
        )

    reference = models.build(name, TWO, "adam")
    uninterrupted = fit(reference, "reference").history
    crashed = models.build(name, TWO, "adam")
    with pytest.raises(KeyboardInterrupt):
        fit(crashed, "run", StopAt(1, 1))  # after the 6th of 8 steps
    resumed = models.build(name, TWO, "adam")
    logs = fit(resumed, "run").history
    assert int(resumed.d_optimizer.iterations.numpy()) == int(
        reference.d_optimizer.iterations.numpy()
    )
    assert _gap(_state(reference), _state(resumed)) == 0.0
    # The resumed epoch's logs (the DCGAN's trackers summed over the epoch) go on from the
    # checkpoint's batch: the uninterrupted run's figures.
    assert set(logs) == set(uninterrupted)
    for key, values in logs.items():
        assert values == pytest.approx([uninterrupted[key][-1]], rel=1e-6, abs=1e-7), key


def test_a_model_without_call_whose_layers_are_not_built_is_refused_in_the_kits_words() -> None:
    @kmk.distributed(global_batch_size=BATCH, devices=TWO)
    def factory() -> keras.Model:
        discriminator = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(1)])
        generator = keras.Sequential([keras.layers.Dense(models.IMAGE * models.IMAGE * 3)])
        gan = models.GAN(discriminator, generator, latent_dim=models.LATENT)
        gan.compile(
            d_optimizer=keras.optimizers.SGD(),
            g_optimizer=keras.optimizers.SGD(),
            loss_fn=keras.losses.BinaryCrossentropy(),
        )
        return gan

    gan = factory()
    with pytest.raises(ValueError, match=r"defines no call\(\) and its layers .* are not built"):
        gan.fit(*models.data("dcgan", 16), batch_size=BATCH, epochs=1, verbose=0)


class ShuffledStep(keras.Model):
    """A step that shuffles its batch with a stateful TensorFlow op."""

    def train_step(self, data):
        x, y = data
        order = tf.random.shuffle(tf.range(tf.shape(x)[0]))
        x, y = tf.gather(x, order), tf.gather(y, order)
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(y - self(x, training=True)))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {"step_loss": loss}


class CountingModel(models.GuideModel1):
    """The guide's step, and a step counter kept in a plain `tf.Variable`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counted = tf.Variable(0, name="steps_counted")


def _counted_or_shuffled(cls: type) -> keras.Model:
    @kmk.distributed(global_batch_size=BATCH, devices=TWO)
    def factory() -> keras.Model:
        inputs = keras.Input((6,))
        model = cls(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    return factory()


def _fit_checkpointed(model: keras.Model, directory: Path) -> None:
    model.fit(
        *models.data("form:mean", 32),
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        callbacks=[kmk.SyncedCheckpoint(directory)],
    )


def test_a_stateful_random_op_no_checkpoint_holds_is_refused_before_any_step(
    tmp_path: Path,
) -> None:
    model = _counted_or_shuffled(ShuffledStep)
    before = model.get_weights()
    with pytest.raises(CheckpointError, match="RandomShuffle") as raised:
        _fit_checkpointed(model, tmp_path / "ckpt")
    assert "nothing was trained" in str(raised.value)
    assert _gap(before, model.get_weights()) == 0.0
    assert not list((tmp_path / "ckpt").glob("ckpt-*"))


def test_a_variable_keras_does_not_track_is_named_before_any_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _counted_or_shuffled(CountingModel)
    assert [v.name for v in untracked_variables(model)] == ["steps_counted:0"]
    assert "state_outside_checkpoint" in [c.code for c in model_causes(model, 2)]
    with caplog.at_level("WARNING", logger="keras_mirror_kit"):
        _fit_checkpointed(model, tmp_path / "ckpt")
    named = [r.getMessage() for r in caplog.records if "does not track" in r.getMessage()]
    assert named and "steps_counted:0" in named[0], caplog.text
    assert int(model.optimizer.iterations.numpy()) == 4


def test_plain_keras_still_scales_losses_per_replica() -> None:
    """Keras divides a Loss object's value by the replica count (keras-team/keras#20609):
    when this fails, `workarounds.keras_own_step_losses` can go."""
    strategy = tf.distribute.MirroredStrategy(TWO)
    y, p = tf.constant([[1.0], [3.0]]), tf.constant([[0.0], [0.0]])

    @tf.function
    def losses():
        return strategy.run(lambda: keras.losses.MeanSquaredError()(y, p))

    values = [float(v) for v in strategy.experimental_local_results(losses())]
    assert values == [2.5, 2.5]  # 5.0, the mean, divided by 2 replicas


USER_MODULE = """
from tests.own_step_models import data, make


def vae():
    return make("vae", "sgd")


def vae_data():  # images alone, as keras-io's vae.fit(mnist_digits) gets them
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(data("vae", 96)[0]).batch(32)


def over_global():
    return make("form:sum_over_global", "sgd")


def form_data():
    return data("form:mean", 96)
"""


def test_doctor_names_the_own_train_step_and_the_refusal(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(USER_MODULE, encoding="utf-8")

    def doctor(*args: str) -> tuple[int, dict]:
        proc = forkserver.run(
            [sys.executable, "-m", "keras_mirror_kit.cli", "doctor", *args, "--json"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
            timeout=600,
            check=False,
        )
        return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {
            "stderr": proc.stderr[-3000:]
        }

    code, report = doctor("--model", "train:vae", "--data", "train:vae_data")
    assert code == 0 and report["passed"] is True, report
    assert report["max_difference"] <= TOLERANCE
    causes = {c["code"]: c for c in report["causes"]}
    assert "own_train_step" in causes, report["causes"]
    assert "1 times" not in causes["own_train_step"]["explanation"]
    assert (
        "2 replicas would apply 2 times one device's gradient"
        in (causes["own_train_step"]["explanation"])
    )
    code, report = doctor("--model", "train:over_global", "--data", "train:form_data")
    assert code != 0, report
    assert "was 1/2 of one device's" in report["error"], report
