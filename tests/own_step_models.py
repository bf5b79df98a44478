"""Models that write their own training step, as keras-io and the Keras guide write them.

Each class below keeps its author's `__init__`, `compile`, `train_step`, `compute_loss` and
`metrics` code as published (only the networks are shrunk, so that a test trains them in
seconds on the CPU):

* `VAE` and `Sampling`: keras-io `examples/generative/vae.py`;
* `GAN`: keras-io `examples/generative/dcgan_overriding_train_step.py` (no `call()`);
* `ConditionalGAN`: keras-io `examples/generative/conditional_gan.py`;
* `WGAN`, `discriminator_loss`, `generator_loss`: keras-io `examples/generative/wgan_gp.py`;
* `Distiller`: keras-io `examples/vision/knowledge_distillation.py`;
* `GuideModel1` to `GuideModel3` and `GuideGAN`: the Keras guide "Customizing what happens
  in `fit()` with TensorFlow" (`guides/custom_train_step_in_tensorflow.py`), whose classes
  are all named `CustomModel` (and `GAN`) there.

`build(name, devices, optimizer)` makes one of them in a kit factory, with fixed first
weights, so that 1 and 2 replicas start from the same state.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

import keras_mirror_kit as kmk
from keras_mirror_kit.workarounds import keras_activity_regularizer_sum

IMAGE = 8  # image side (keras-io: 28 or 64)
LATENT = 4  # latent_dim (keras-io: 2 or 128)
num_classes = 3  # noqa: N816 (the conditional GAN's module-level names)
image_size = IMAGE


# --- keras-io: examples/generative/vae.py -----------------------------------------------


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [
            self.total_loss_tracker,
            self.reconstruction_loss_tracker,
            self.kl_loss_tracker,
        ]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction),
                    axis=(1, 2),
                )
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def vae_networks():
    encoder_inputs = keras.Input(shape=(IMAGE, IMAGE, 1))
    x = layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Flatten()(x)
    x = layers.Dense(8, activation="relu")(x)
    z_mean = layers.Dense(LATENT, name="z_mean")(x)
    z_log_var = layers.Dense(LATENT, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input(shape=(LATENT,))
    x = layers.Dense(IMAGE // 2 * IMAGE // 2 * 4, activation="relu")(latent_inputs)
    x = layers.Reshape((IMAGE // 2, IMAGE // 2, 4))(x)
    x = layers.Conv2DTranspose(4, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    return encoder, decoder


# --- keras-io: examples/generative/dcgan_overriding_train_step.py -----------------------


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        # Sample random points in the latent space
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        # Decode them to fake images
        generated_images = self.generator(random_latent_vectors)
        # Combine them with real images
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        # Assemble labels discriminating real from fake images
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        # Add random noise to the labels - important trick!
        labels += 0.05 * tf.random.uniform(tf.shape(labels))
        # Train the discriminator
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        # Sample random points in the latent space
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        # Assemble labels that say "all real images"
        misleading_labels = ops.zeros((batch_size, 1))
        # Train the generator (note that we should *not* update the weights
        # of the discriminator)!
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        # Update metrics
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {
            "d_loss": self.d_loss_metric.result(),
            "g_loss": self.g_loss_metric.result(),
        }


class GANWithCall(GAN):
    """The DCGAN with a `call()` added (what a user tries when Keras cannot build it)."""

    def call(self, inputs):
        return self.discriminator(inputs)


def dcgan_networks(dropout: float = 0.2):
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(IMAGE, IMAGE, 3)),
            layers.Conv2D(4, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Flatten(),
            layers.Dropout(dropout),
            layers.Dense(1, activation="sigmoid"),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(LATENT,)),
            layers.Dense(IMAGE // 2 * IMAGE // 2 * 4),
            layers.Reshape((IMAGE // 2, IMAGE // 2, 4)),
            layers.Conv2DTranspose(4, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(3, kernel_size=5, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    return discriminator, generator


# --- keras-io: examples/generative/conditional_gan.py -----------------------------------


class ConditionalGAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.gen_loss_tracker = keras.metrics.Mean(name="generator_loss")
        self.disc_loss_tracker = keras.metrics.Mean(name="discriminator_loss")

    @property
    def metrics(self):
        return [self.gen_loss_tracker, self.disc_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, data):
        # Unpack the data.
        real_images, one_hot_labels = data

        # Add dummy dimensions to the labels so that they can be concatenated with
        # the images. This is for the discriminator.
        image_one_hot_labels = one_hot_labels[:, :, None, None]
        image_one_hot_labels = ops.repeat(image_one_hot_labels, repeats=[image_size * image_size])
        image_one_hot_labels = ops.reshape(
            image_one_hot_labels, (-1, image_size, image_size, num_classes)
        )

        # Sample random points in the latent space and concatenate the labels.
        # This is for the generator.
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        random_vector_labels = ops.concatenate([random_latent_vectors, one_hot_labels], axis=1)

        # Decode the noise (guided by labels) to fake images.
        generated_images = self.generator(random_vector_labels)

        # Combine them with real images. Note that we are concatenating the labels
        # with these images here.
        fake_image_and_labels = ops.concatenate([generated_images, image_one_hot_labels], -1)
        real_image_and_labels = ops.concatenate([real_images, image_one_hot_labels], -1)
        combined_images = ops.concatenate([fake_image_and_labels, real_image_and_labels], axis=0)

        # Assemble labels discriminating real from fake images.
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)

        # Train the discriminator.
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        # Sample random points in the latent space.
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        random_vector_labels = ops.concatenate([random_latent_vectors, one_hot_labels], axis=1)

        # Assemble labels that say "all real images".
        misleading_labels = ops.zeros((batch_size, 1))

        # Train the generator (note that we should *not* update the weights
        # of the discriminator)!
        with tf.GradientTape() as tape:
            fake_images = self.generator(random_vector_labels)
            fake_image_and_labels = ops.concatenate([fake_images, image_one_hot_labels], -1)
            predictions = self.discriminator(fake_image_and_labels)
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        # Monitor loss.
        self.gen_loss_tracker.update_state(g_loss)
        self.disc_loss_tracker.update_state(d_loss)
        return {
            "g_loss": self.gen_loss_tracker.result(),
            "d_loss": self.disc_loss_tracker.result(),
        }


def conditional_networks():
    discriminator = keras.Sequential(
        [
            layers.InputLayer((IMAGE, IMAGE, 1 + num_classes)),
            layers.Conv2D(4, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            layers.InputLayer((LATENT + num_classes,)),
            layers.Dense(IMAGE // 2 * IMAGE // 2 * 4),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((IMAGE // 2, IMAGE // 2, 4)),
            layers.Conv2DTranspose(4, (4, 4), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, (3, 3), padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    return discriminator, generator


# --- keras-io: examples/generative/wgan_gp.py --------------------------------------------


class WGAN(keras.Model):
    def __init__(
        self,
        discriminator,
        generator,
        latent_dim,
        discriminator_extra_steps=3,
        gp_weight=10.0,
    ):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        """Calculates the gradient penalty.

        This loss is calculated on an interpolated image
        and added to the discriminator loss.
        """
        # Get the interpolated image
        alpha = tf.random.uniform([batch_size, 1, 1, 1], 0.0, 1.0)
        diff = fake_images - real_images
        interpolated = real_images + alpha * diff

        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            # 1. Get the discriminator output for this interpolated image.
            pred = self.discriminator(interpolated, training=True)

        # 2. Calculate the gradients w.r.t to this interpolated image.
        grads = gp_tape.gradient(pred, [interpolated])[0]
        # 3. Calculate the norm of the gradients.
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]) + keras.backend.epsilon())
        gp = tf.reduce_mean((norm - 1.0) ** 2)
        return gp

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]

        # Get the batch size
        batch_size = tf.shape(real_images)[0]

        for _i in range(self.d_steps):
            # Get the latent vector
            random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
            with tf.GradientTape() as tape:
                # Generate fake images from the latent vector
                fake_images = self.generator(random_latent_vectors, training=True)
                # Get the logits for the fake images
                fake_logits = self.discriminator(fake_images, training=True)
                # Get the logits for the real images
                real_logits = self.discriminator(real_images, training=True)

                # Calculate the discriminator loss using the fake and real image logits
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                # Calculate the gradient penalty
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                # Add the gradient penalty to the original discriminator loss
                d_loss = d_cost + gp * self.gp_weight

            # Get the gradients w.r.t the discriminator loss
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            # Update the weights of the discriminator using the discriminator optimizer
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables)
            )

        # Train the generator
        # Get the latent vector
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        with tf.GradientTape() as tape:
            # Generate fake images using the generator
            generated_images = self.generator(random_latent_vectors, training=True)
            # Get the discriminator logits for fake images
            gen_img_logits = self.discriminator(generated_images, training=True)
            # Calculate the generator loss
            g_loss = self.g_loss_fn(gen_img_logits)

        # Get the gradients w.r.t the generator loss
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        # Update the weights of the generator using the generator optimizer
        self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


def discriminator_loss(real_img, fake_img):
    real_loss = tf.reduce_mean(real_img)
    fake_loss = tf.reduce_mean(fake_img)
    return fake_loss - real_loss


def generator_loss(fake_img):
    return -tf.reduce_mean(fake_img)


def wgan_networks():
    discriminator = keras.Sequential(
        [
            keras.Input((IMAGE, IMAGE, 1)),
            layers.Conv2D(4, (5, 5), strides=(2, 2), padding="same"),
            layers.LeakyReLU(0.2),
            layers.Flatten(),
            layers.Dense(1),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input((LATENT,)),
            layers.Dense(IMAGE // 2 * IMAGE // 2 * 4, use_bias=False),
            layers.LeakyReLU(0.2),
            layers.Reshape((IMAGE // 2, IMAGE // 2, 4)),
            layers.UpSampling2D((2, 2)),
            layers.Conv2D(1, (3, 3), padding="same", activation="tanh"),
        ],
        name="generator",
    )
    return discriminator, generator


# --- keras-io: examples/vision/knowledge_distillation.py --------------------------------


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(
        self,
        optimizer,
        metrics,
        student_loss_fn,
        distillation_loss_fn,
        alpha=0.1,
        temperature=3,
    ):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)

        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)

        loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        return loss

    def call(self, x):
        return self.student(x)


def distiller_networks():
    teacher = keras.Sequential(
        [
            keras.Input(shape=(IMAGE, IMAGE, 1)),
            layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Flatten(),
            layers.Dense(num_classes),
        ],
        name="teacher",
    )
    student = keras.Sequential(
        [
            keras.Input(shape=(IMAGE, IMAGE, 1)),
            layers.Conv2D(4, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Flatten(),
            layers.Dense(num_classes),
        ],
        name="student",
    )
    return student, teacher


# --- the Keras guide: guides/custom_train_step_in_tensorflow.py -------------------------


class GuideModel1(keras.Model):
    """The guide's first `CustomModel`: `self.compute_loss` and `optimizer.apply`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)  # Forward pass
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GuideModel2(keras.Model):
    """The guide's second `CustomModel`: its own `Loss` object and metrics."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)  # Forward pass
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {
            "loss": self.loss_tracker.result(),
            "mae": self.mae_metric.result(),
        }

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class GuideModel3(keras.Model):
    """The guide's third `CustomModel`: `sample_weight` through `compute_loss`."""

    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)  # Forward pass
            loss = self.compute_loss(
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
            )
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class GuideModel4(keras.Model):
    """The guide's fourth `CustomModel`: its own `test_step` only (Keras' `train_step`)."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class CountingStep(GuideModel2):
    """The guide's second step, counting its batches in a `Sum` given an integer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches = keras.metrics.Sum(name="batches")

    def train_step(self, data):
        logs = super().train_step(data)
        self.batches.update_state(1)
        return {**logs, "batches": self.batches.result()}

    @property
    def metrics(self):
        return [*super().metrics, self.batches]


class GuideGAN(keras.Model):
    """The guide's end-to-end `GAN`: seeded latents and label noise, `optimizer.apply`."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {
            "d_loss": self.d_loss_tracker.result(),
            "g_loss": self.g_loss_tracker.result(),
        }


def guide_gan_networks():
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(IMAGE, IMAGE, 1)),
            layers.Conv2D(4, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(LATENT,)),
            layers.Dense(IMAGE // 2 * IMAGE // 2 * 4),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((IMAGE // 2, IMAGE // 2, 4)),
            layers.Conv2DTranspose(4, (4, 4), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, (3, 3), padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    return discriminator, generator


# --- every other way a step may write its loss ------------------------------------------

GLOBAL_BATCH = 8  # `build`'s global batch size, as a script would hard-code it


class LossForms(keras.Model):
    """A regression step whose loss is written one of the ways of `FORMS` (`self.form`)."""

    form = "mean"

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            per_row = ops.mean(ops.square(y - y_pred), axis=-1)
            if self.form == "mean":  # keras.losses function, ops.mean
                loss = ops.mean(keras.losses.mean_squared_error(y, y_pred))
            elif self.form == "sum_over_rows":  # a plain sum over the batch's rows
                loss = ops.sum(per_row) / ops.cast(ops.shape(x)[0], "float32")
            elif self.form == "compute_average_loss":
                loss = tf.nn.compute_average_loss(per_row)
            elif self.form == "compute_average_loss_global":  # TensorFlow's tutorial
                loss = tf.nn.compute_average_loss(per_row, global_batch_size=GLOBAL_BATCH)
            elif self.form == "add_loss":  # the activity regularizer's add_loss term
                loss = ops.mean(per_row) + ops.sum(self.losses)
            elif self.form == "sum_over_global":  # refused: tf.distribute's convention
                loss = ops.sum(per_row) / GLOBAL_BATCH
            elif self.form == "over_replicas":  # refused: tf.distribute's convention
                loss = ops.mean(per_row) / self.distribute_strategy.num_replicas_in_sync
            else:
                raise ValueError(self.form)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {"step_loss": loss}  # "loss" would be Keras' unused tracker at epoch end


FORMS = (
    "mean",
    "sum_over_rows",
    "compute_average_loss",
    "compute_average_loss_global",
    "add_loss",
    "sum_over_global",
    "over_replicas",
)


# --- builders ----------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "adam": lambda: keras.optimizers.Adam(1e-3),
}


def _dense_inputs():
    inputs = keras.Input(shape=(6,))
    hidden = layers.Dense(5, activation="relu")(inputs)
    return inputs, layers.Dense(1)(hidden)


def make(name: str, optimizer: str = "sgd", **options):
    """One model of this module, built and compiled as its author does (call in a factory)."""
    opt = OPTIMIZERS[optimizer]
    if name == "vae":
        model = VAE(*vae_networks())
        model.compile(optimizer=opt())
    elif name in ("dcgan", "dcgan_call"):
        cls = GANWithCall if name == "dcgan_call" else GAN
        model = cls(*dcgan_networks(**options), latent_dim=LATENT)
        model.compile(
            d_optimizer=opt(), g_optimizer=opt(), loss_fn=keras.losses.BinaryCrossentropy()
        )
    elif name == "cgan":
        model = ConditionalGAN(*conditional_networks(), latent_dim=LATENT)
        model.compile(
            d_optimizer=opt(),
            g_optimizer=opt(),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    elif name == "wgan":
        model = WGAN(*wgan_networks(), latent_dim=LATENT, discriminator_extra_steps=2)
        model.compile(
            d_optimizer=opt(),
            g_optimizer=opt(),
            g_loss_fn=generator_loss,
            d_loss_fn=discriminator_loss,
        )
    elif name == "distiller":
        model = Distiller(*distiller_networks())
        model.compile(
            optimizer=opt(),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
            student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            distillation_loss_fn=keras.losses.KLDivergence(),
            alpha=0.1,
            temperature=10,
        )
    elif name in ("guide1", "guide2", "guide3", "guide4", "counting"):
        cls = {
            "guide1": GuideModel1,
            "guide2": GuideModel2,
            "guide3": GuideModel3,
            "guide4": GuideModel4,
            "counting": CountingStep,
        }[name]
        model = cls(*_dense_inputs())
        if name in ("guide2", "counting"):
            model.compile(optimizer=opt())
        else:
            model.compile(optimizer=opt(), loss="mse", metrics=["mae"])
    elif name.startswith("form:"):
        inputs = keras.Input(shape=(6,))
        # Before Keras 3.14 an activity regularizer sums over the batch, which the kit
        # refuses on several replicas: there only form:add_loss keeps it (to be refused).
        form = name.split(":", 1)[1]
        sums = keras_activity_regularizer_sum.sums_over_the_batch()
        regularizer = keras.regularizers.L2(1e-2) if form == "add_loss" or not sums else None
        hidden = layers.Dense(5, activation="relu", activity_regularizer=regularizer)(inputs)
        model = LossForms(inputs, layers.Dense(1)(hidden))
        model.form = name.split(":", 1)[1]
        model.compile(optimizer=opt())
    elif name == "guide_gan":
        model = GuideGAN(*guide_gan_networks(), latent_dim=LATENT)
        model.compile(
            d_optimizer=opt(),
            g_optimizer=opt(),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    else:
        raise ValueError(f"unknown model {name!r}")
    return model


def data(name: str, n: int = 32, seed: int = 0):
    """What `fit` gets for model `name`: `(x,)` or `(x, y)` (NumPy arrays)."""
    rng = np.random.default_rng(seed)
    if name in ("vae",):
        return (rng.uniform(size=(n, IMAGE, IMAGE, 1)).astype("float32"),)
    if name in ("dcgan", "dcgan_call"):
        return (rng.uniform(size=(n, IMAGE, IMAGE, 3)).astype("float32"),)
    if name in ("wgan", "guide_gan"):
        return (rng.uniform(-1, 1, size=(n, IMAGE, IMAGE, 1)).astype("float32"),)
    if name == "cgan":
        images = rng.uniform(size=(n, IMAGE, IMAGE, 1)).astype("float32")
        labels = np.eye(num_classes, dtype="float32")[rng.integers(0, num_classes, n)]
        return images, labels
    if name == "distiller":
        images = rng.uniform(size=(n, IMAGE, IMAGE, 1)).astype("float32")
        return images, rng.integers(0, num_classes, n).astype("int32")
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, (x[:, :1] * 0.5 + rng.normal(size=(n, 1)) * 0.1).astype("float32")


def build(
    name: str, devices, optimizer: str = "sgd", global_batch_size: int = GLOBAL_BATCH, **options
):
    """`make(name, optimizer)` in a kit factory on `devices`, with fixed first weights."""

    @kmk.distributed(global_batch_size=global_batch_size, devices=devices)
    def factory():
        keras.utils.set_random_seed(7)
        return make(name, optimizer, **options)

    return factory()
