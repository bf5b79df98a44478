"""Six keras-io examples adopt the kit in at most 10 edits each (docs/keras-io-examples.md).

Each example's keras-io code is embedded below (its code cells in order; its shell cells,
the downloads, are left out; of the transfer-learning guide, its end-to-end example, which
compiles and fits twice). For each example the test reads the ```diff block of its
section in docs/keras-io-examples.md, applies it to that code (so the page cannot drift
from what runs), counts its edits, shrinks a few constants (listed per example: image
size, batch, epochs, vocabulary, the image example's network to its first residual
block at narrower widths, the guide's base to an untrained MobileNetV2 cut after its first
residual block; the data is generated here, in the example's formats and folder layout,
tens of samples), and runs two children (`tests/keras_io_child.py`, forked from the tests'
zygote, 2 replicas simulated on the CPU):

1. the adopted script, SIGKILLed right after the first training step of its second epoch
   (the guide: of its fine-tuning `fit`, after the second `compile`; the child follows its
   own progress marker after each step, never a timer);
2. one process that records the original script's `fit` data (the original stops at its
   `fit` call), runs the adopted script uninterrupted (it stops once its `fit` returned),
   then runs it again where it was killed: it resumes from the killed run's checkpoint
   and runs to the script's end.

Checked per example: (a) at most 10 edits, and the counts the page states (a fast test,
no child); (b) the validation samples `fit` evaluates equal the original's (in order
where the original's are in a fixed order, as a multiset where the original shuffles
them); (c) one epoch of the training data holds exactly the original's training samples,
each once; (d) the resumed run restored the step it was killed at, trained only the
steps after it, and ends on the uninterrupted run's weights bit for bit, every replica's
copy of them too, with the same validation logs for the last epoch; (e) the example's
own steps after `fit` ran in the resumed run (predict on one sample, evaluate) with
finite results, and the fitted model saved to `.keras` loads back with
`keras.models.load_model` and predicts the same on a validation sample, and evaluates the
validation data as the resumed `fit`'s last validation did. The adopted script's runs
give NumPy's global generator another seed each (`tests/keras_io_child.py`), so data
drawn from it unseeded fails (d). A script with several `fit` calls is rerun whole: those
before the killed one train nothing, and (d) holds for the killed one.

The guide is also run uninterrupted on 1 and on 2 replicas (both compiles; Adam at the
guide's rates, and SGD in its place): the final weights agree within 2e-4 and 1e-6.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests import forkserver
from tests.subproc import REPO, last_json

DOC = REPO / "docs" / "keras-io-examples.md"
MAX_EDITS = 10


# keras-io examples/vision/image_classification_from_scratch.py
# (its Keras 3 version), its code cells only.
IMAGE_CLASSIFICATION = r"""
import os
import numpy as np
import keras
from keras import layers
from tensorflow import data as tf_data
import matplotlib.pyplot as plt

num_skipped = 0
for folder_name in ("Cat", "Dog"):
    folder_path = os.path.join("PetImages", folder_name)
    for fname in os.listdir(folder_path):
        fpath = os.path.join(folder_path, fname)
        try:
            fobj = open(fpath, "rb")
            is_jfif = b"JFIF" in fobj.peek(10)
        finally:
            fobj.close()

        if not is_jfif:
            num_skipped += 1
            # Delete corrupted image
            os.remove(fpath)

print(f"Deleted {num_skipped} images.")

image_size = (180, 180)
batch_size = 128

train_ds, val_ds = keras.utils.image_dataset_from_directory(
    "PetImages",
    validation_split=0.2,
    subset="both",
    seed=1337,
    image_size=image_size,
    batch_size=batch_size,
)

plt.figure(figsize=(10, 10))
for images, labels in train_ds.take(1):
    for i in range(9):
        ax = plt.subplot(3, 3, i + 1)
        plt.imshow(np.array(images[i]).astype("uint8"))
        plt.title(int(labels[i]))
        plt.axis("off")

data_augmentation_layers = [
    layers.RandomFlip("horizontal"),
    layers.RandomRotation(0.1),
]


def data_augmentation(images):
    for layer in data_augmentation_layers:
        images = layer(images)
    return images


plt.figure(figsize=(10, 10))
for images, _ in train_ds.take(1):
    for i in range(9):
        augmented_images = data_augmentation(images)
        ax = plt.subplot(3, 3, i + 1)
        plt.imshow(np.array(augmented_images[0]).astype("uint8"))
        plt.axis("off")

# Apply `data_augmentation` to the training images.
train_ds = train_ds.map(
    lambda img, label: (data_augmentation(img), label),
    num_parallel_calls=tf_data.AUTOTUNE,
)
# Prefetching samples in GPU memory helps maximize GPU utilization.
train_ds = train_ds.prefetch(tf_data.AUTOTUNE)
val_ds = val_ds.prefetch(tf_data.AUTOTUNE)


def make_model(input_shape, num_classes):
    inputs = keras.Input(shape=input_shape)

    # Entry block
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(128, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    previous_block_activation = x  # Set aside residual

    for size in [256, 512, 728]:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)

        # Project residual
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(
            previous_block_activation
        )
        x = layers.add([x, residual])  # Add back residual
        previous_block_activation = x  # Set aside next residual

    x = layers.SeparableConv2D(1024, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    x = layers.GlobalAveragePooling2D()(x)
    if num_classes == 2:
        units = 1
    else:
        units = num_classes

    x = layers.Dropout(0.25)(x)
    # We specify activation=None so as to return logits
    outputs = layers.Dense(units, activation=None)(x)
    return keras.Model(inputs, outputs)


model = make_model(input_shape=image_size + (3,), num_classes=2)
keras.utils.plot_model(model, show_shapes=True)

epochs = 25

callbacks = [
    keras.callbacks.ModelCheckpoint("save_at_{epoch}.keras"),
]
model.compile(
    optimizer=keras.optimizers.Adam(3e-4),
    loss=keras.losses.BinaryCrossentropy(from_logits=True),
    metrics=[keras.metrics.BinaryAccuracy(name="acc")],
)
model.fit(
    train_ds,
    epochs=epochs,
    callbacks=callbacks,
    validation_data=val_ds,
)

img = keras.utils.load_img("PetImages/Cat/6779.jpg", target_size=image_size)
plt.imshow(img)

img_array = keras.utils.img_to_array(img)
img_array = keras.ops.expand_dims(img_array, 0)  # Create batch axis

predictions = model.predict(img_array)
score = float(keras.ops.sigmoid(predictions[0][0]))
print(f"This image is {100 * (1 - score):.2f}% cat and {100 * score:.2f}% dog.")
"""[1:]

# keras-io examples/nlp/text_classification_from_scratch.py
# (its Keras 3 version), its code cells only.
TEXT_CLASSIFICATION = r"""
import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras
import tensorflow as tf
import numpy as np
from keras import layers

batch_size = 32
raw_train_ds = keras.utils.text_dataset_from_directory(
    "aclImdb/train",
    batch_size=batch_size,
    validation_split=0.2,
    subset="training",
    seed=1337,
)
raw_val_ds = keras.utils.text_dataset_from_directory(
    "aclImdb/train",
    batch_size=batch_size,
    validation_split=0.2,
    subset="validation",
    seed=1337,
)
raw_test_ds = keras.utils.text_dataset_from_directory(
    "aclImdb/test", batch_size=batch_size
)

print(f"Number of batches in raw_train_ds: {raw_train_ds.cardinality()}")
print(f"Number of batches in raw_val_ds: {raw_val_ds.cardinality()}")
print(f"Number of batches in raw_test_ds: {raw_test_ds.cardinality()}")

# It's important to take a look at your raw data to ensure your normalization
# and tokenization will work as expected. We can do that by taking a few
# examples from the training set and looking at them.
# This is one of the places where eager execution shines:
# we can just evaluate these tensors using .numpy()
# instead of needing to evaluate them in a Session/Graph context.
for text_batch, label_batch in raw_train_ds.take(1):
    for i in range(5):
        print(text_batch.numpy()[i])
        print(label_batch.numpy()[i])

import string
import re


# Having looked at our data above, we see that the raw text contains HTML break
# tags of the form '<br />'. These tags will not be removed by the default
# standardizer (which doesn't strip HTML). Because of this, we will need to
# create a custom standardization function.
def custom_standardization(input_data):
    lowercase = tf.strings.lower(input_data)
    stripped_html = tf.strings.regex_replace(lowercase, "<br />", " ")
    return tf.strings.regex_replace(
        stripped_html, f"[{re.escape(string.punctuation)}]", ""
    )


# Model constants.
max_features = 20000
embedding_dim = 128
sequence_length = 500

# Now that we have our custom standardization, we can instantiate our text
# vectorization layer. We are using this layer to normalize, split, and map
# strings to integers, so we set our 'output_mode' to 'int'.
# Note that we're using the default split function,
# and the custom standardization defined above.
# We also set an explicit maximum sequence length, since the CNNs later in our
# model won't support ragged sequences.
vectorize_layer = keras.layers.TextVectorization(
    standardize=custom_standardization,
    max_tokens=max_features,
    output_mode="int",
    output_sequence_length=sequence_length,
)

# Now that the vectorize_layer has been created, call `adapt` on a text-only
# dataset to create the vocabulary. You don't have to batch, but for very large
# datasets this means you're not keeping spare copies of the dataset in memory.

# Let's make a text-only dataset (no labels):
text_ds = raw_train_ds.map(lambda x, y: x)
# Let's call `adapt`:
vectorize_layer.adapt(text_ds)


def vectorize_text(text, label):
    text = tf.expand_dims(text, -1)
    return vectorize_layer(text), label


# Vectorize the data.
train_ds = raw_train_ds.map(vectorize_text)
val_ds = raw_val_ds.map(vectorize_text)
test_ds = raw_test_ds.map(vectorize_text)

# Do async prefetching / buffering of the data for best performance on GPU.
train_ds = train_ds.cache().prefetch(buffer_size=10)
val_ds = val_ds.cache().prefetch(buffer_size=10)
test_ds = test_ds.cache().prefetch(buffer_size=10)

# A integer input for vocab indices.
inputs = keras.Input(shape=(None,), dtype="int64")

# Next, we add a layer to map those vocab indices into a space of dimensionality
# 'embedding_dim'.
x = layers.Embedding(max_features, embedding_dim)(inputs)
x = layers.Dropout(0.5)(x)

# Conv1D + global max pooling
x = layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(x)
x = layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(x)
x = layers.GlobalMaxPooling1D()(x)

# We add a vanilla hidden layer:
x = layers.Dense(128, activation="relu")(x)
x = layers.Dropout(0.5)(x)

# We project onto a single unit output layer, and squash it with a sigmoid:
predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)

model = keras.Model(inputs, predictions)

# Compile the model with binary crossentropy loss and an adam optimizer.
model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])

epochs = 3

# Fit the model using the train and test datasets.
model.fit(train_ds, validation_data=val_ds, epochs=epochs)

model.evaluate(test_ds)

# A string input
inputs = keras.Input(shape=(1,), dtype="string")
# Turn strings into vocab indices
indices = vectorize_layer(inputs)
# Turn vocab indices into predictions
outputs = model(indices)

# Our end to end model
end_to_end_model = keras.Model(inputs, outputs)
end_to_end_model.compile(
    loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"]
)

# Test it with `raw_test_ds`, which yields raw strings
end_to_end_model.evaluate(raw_test_ds)
"""[1:]

# keras-io examples/structured_data/structured_data_classification_with_feature_space.py
# (its Keras 3 version), its code cells only.
STRUCTURED_DATA = r"""
import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import tensorflow as tf
import pandas as pd
import keras
from keras.utils import FeatureSpace

file_url = (
    "http://storage.googleapis.com/download.tensorflow.org/data/heart.csv"
)
dataframe = pd.read_csv(file_url)

print(dataframe.shape)

dataframe.head()

val_dataframe = dataframe.sample(frac=0.2, random_state=1337)
train_dataframe = dataframe.drop(val_dataframe.index)

print(
    "Using %d samples for training and %d for validation"
    % (len(train_dataframe), len(val_dataframe))
)


def dataframe_to_dataset(dataframe):
    dataframe = dataframe.copy()
    labels = dataframe.pop("target")
    ds = tf.data.Dataset.from_tensor_slices((dict(dataframe), labels))
    ds = ds.shuffle(buffer_size=len(dataframe))
    return ds


train_ds = dataframe_to_dataset(train_dataframe)
val_ds = dataframe_to_dataset(val_dataframe)

for x, y in train_ds.take(1):
    print("Input:", x)
    print("Target:", y)

train_ds = train_ds.batch(32)
val_ds = val_ds.batch(32)

feature_space = FeatureSpace(
    features={
        # Categorical features encoded as integers
        "sex": "integer_categorical",
        "cp": "integer_categorical",
        "fbs": "integer_categorical",
        "restecg": "integer_categorical",
        "exang": "integer_categorical",
        "ca": "integer_categorical",
        # Categorical feature encoded as string
        "thal": "string_categorical",
        # Numerical features to discretize
        "age": "float_discretized",
        # Numerical features to normalize
        "trestbps": "float_normalized",
        "chol": "float_normalized",
        "thalach": "float_normalized",
        "oldpeak": "float_normalized",
        "slope": "float_normalized",
    },
    # We create additional features by hashing
    # value co-occurrences for the
    # following groups of categorical features.
    crosses=[("sex", "age"), ("thal", "ca")],
    # The hashing space for these co-occurrences
    # wil be 32-dimensional.
    crossing_dim=32,
    # Our utility will one-hot encode all categorical
    # features and concat all features into a single
    # vector (one vector per sample).
    output_mode="concat",
)

feature_space = FeatureSpace(
    features={
        # Categorical features encoded as integers
        "sex": FeatureSpace.integer_categorical(num_oov_indices=0),
        "cp": FeatureSpace.integer_categorical(num_oov_indices=0),
        "fbs": FeatureSpace.integer_categorical(num_oov_indices=0),
        "restecg": FeatureSpace.integer_categorical(num_oov_indices=0),
        "exang": FeatureSpace.integer_categorical(num_oov_indices=0),
        "ca": FeatureSpace.integer_categorical(num_oov_indices=0),
        # Categorical feature encoded as string
        "thal": FeatureSpace.string_categorical(num_oov_indices=0),
        # Numerical features to discretize
        "age": FeatureSpace.float_discretized(num_bins=30),
        # Numerical features to normalize
        "trestbps": FeatureSpace.float_normalized(),
        "chol": FeatureSpace.float_normalized(),
        "thalach": FeatureSpace.float_normalized(),
        "oldpeak": FeatureSpace.float_normalized(),
        "slope": FeatureSpace.float_normalized(),
    },
    # Specify feature cross with a custom crossing dim.
    crosses=[
        FeatureSpace.cross(feature_names=("sex", "age"), crossing_dim=64),
        FeatureSpace.cross(
            feature_names=("thal", "ca"),
            crossing_dim=16,
        ),
    ],
    output_mode="concat",
)

train_ds_with_no_labels = train_ds.map(lambda x, _: x)
feature_space.adapt(train_ds_with_no_labels)

for x, _ in train_ds.take(1):
    preprocessed_x = feature_space(x)
    print("preprocessed_x.shape:", preprocessed_x.shape)
    print("preprocessed_x.dtype:", preprocessed_x.dtype)

preprocessed_train_ds = train_ds.map(
    lambda x, y: (feature_space(x), y), num_parallel_calls=tf.data.AUTOTUNE
)
preprocessed_train_ds = preprocessed_train_ds.prefetch(tf.data.AUTOTUNE)

preprocessed_val_ds = val_ds.map(
    lambda x, y: (feature_space(x), y), num_parallel_calls=tf.data.AUTOTUNE
)
preprocessed_val_ds = preprocessed_val_ds.prefetch(tf.data.AUTOTUNE)

dict_inputs = feature_space.get_inputs()
encoded_features = feature_space.get_encoded_features()

x = keras.layers.Dense(32, activation="relu")(encoded_features)
x = keras.layers.Dropout(0.5)(x)
predictions = keras.layers.Dense(1, activation="sigmoid")(x)

training_model = keras.Model(inputs=encoded_features, outputs=predictions)
training_model.compile(
    optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"]
)

inference_model = keras.Model(inputs=dict_inputs, outputs=predictions)

training_model.fit(
    preprocessed_train_ds,
    epochs=20,
    validation_data=preprocessed_val_ds,
    verbose=2,
)

sample = {
    "age": 60,
    "sex": 1,
    "cp": 1,
    "trestbps": 145,
    "chol": 233,
    "fbs": 1,
    "restecg": 2,
    "thalach": 150,
    "exang": 0,
    "oldpeak": 2.3,
    "slope": 3,
    "ca": 0,
    "thal": "fixed",
}

input_dict = {
    name: tf.convert_to_tensor([value]) for name, value in sample.items()
}
predictions = inference_model.predict(input_dict)

print(
    f"This particular patient had a {100 * predictions[0][0]:.2f}% probability "
    "of having a heart disease, as evaluated by our model."
)
"""[1:]

# keras-io examples/timeseries/timeseries_classification_from_scratch.py
# (its Keras 3 version), its code cells only.
TIMESERIES = r"""
import keras
import numpy as np
import matplotlib.pyplot as plt


def readucr(filename):
    data = np.loadtxt(filename, delimiter="\t")
    y = data[:, 0]
    x = data[:, 1:]
    return x, y.astype(int)


root_url = "https://raw.githubusercontent.com/hfawaz/cd-diagram/master/FordA/"

x_train, y_train = readucr(root_url + "FordA_TRAIN.tsv")
x_test, y_test = readucr(root_url + "FordA_TEST.tsv")

classes = np.unique(np.concatenate((y_train, y_test), axis=0))

plt.figure()
for c in classes:
    c_x_train = x_train[y_train == c]
    plt.plot(c_x_train[0], label="class " + str(c))
plt.legend(loc="best")
plt.show()
plt.close()

x_train = x_train.reshape((x_train.shape[0], x_train.shape[1], 1))
x_test = x_test.reshape((x_test.shape[0], x_test.shape[1], 1))

num_classes = len(np.unique(y_train))

idx = np.random.permutation(len(x_train))
x_train = x_train[idx]
y_train = y_train[idx]

y_train[y_train == -1] = 0
y_test[y_test == -1] = 0


def make_model(input_shape):
    input_layer = keras.layers.Input(input_shape)

    conv1 = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(input_layer)
    conv1 = keras.layers.BatchNormalization()(conv1)
    conv1 = keras.layers.ReLU()(conv1)

    conv2 = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(conv1)
    conv2 = keras.layers.BatchNormalization()(conv2)
    conv2 = keras.layers.ReLU()(conv2)

    conv3 = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(conv2)
    conv3 = keras.layers.BatchNormalization()(conv3)
    conv3 = keras.layers.ReLU()(conv3)

    gap = keras.layers.GlobalAveragePooling1D()(conv3)

    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)

    return keras.models.Model(inputs=input_layer, outputs=output_layer)


model = make_model(input_shape=x_train.shape[1:])
keras.utils.plot_model(model, show_shapes=True)

epochs = 500
batch_size = 32

callbacks = [
    keras.callbacks.ModelCheckpoint(
        "best_model.keras", save_best_only=True, monitor="val_loss"
    ),
    keras.callbacks.ReduceLROnPlateau(
        monitor="val_loss", factor=0.5, patience=20, min_lr=0.0001
    ),
    keras.callbacks.EarlyStopping(monitor="val_loss", patience=50, verbose=1),
]
model.compile(
    optimizer="adam",
    loss="sparse_categorical_crossentropy",
    metrics=["sparse_categorical_accuracy"],
)
history = model.fit(
    x_train,
    y_train,
    batch_size=batch_size,
    epochs=epochs,
    callbacks=callbacks,
    validation_split=0.2,
    verbose=1,
)

model = keras.models.load_model("best_model.keras")

test_loss, test_acc = model.evaluate(x_test, y_test)

print("Test accuracy", test_acc)
print("Test loss", test_loss)

metric = "sparse_categorical_accuracy"
plt.figure()
plt.plot(history.history[metric])
plt.plot(history.history["val_" + metric])
plt.title("model " + metric)
plt.ylabel(metric, fontsize="large")
plt.xlabel("epoch", fontsize="large")
plt.legend(["train", "val"], loc="best")
plt.show()
plt.close()
"""[1:]

# keras-io examples/nlp/text_classification_with_transformer.py
# (its Keras 3 version), its code cells only.
TRANSFORMER = r"""
import keras
from keras import ops
from keras import layers


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [
                layers.Dense(ff_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


vocab_size = 20000  # Only consider the top 20k words
maxlen = 200  # Only consider the first 200 words of each movie review
(x_train, y_train), (x_val, y_val) = keras.datasets.imdb.load_data(num_words=vocab_size)
print(len(x_train), "Training sequences")
print(len(x_val), "Validation sequences")
x_train = keras.utils.pad_sequences(x_train, maxlen=maxlen)
x_val = keras.utils.pad_sequences(x_val, maxlen=maxlen)


embed_dim = 32  # Embedding size for each token
num_heads = 2  # Number of attention heads
ff_dim = 32  # Hidden layer size in feed forward network inside transformer

inputs = layers.Input(shape=(maxlen,))
embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
x = embedding_layer(inputs)
transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
x = transformer_block(x)
x = layers.GlobalAveragePooling1D()(x)
x = layers.Dropout(0.1)(x)
x = layers.Dense(20, activation="relu")(x)
x = layers.Dropout(0.1)(x)
outputs = layers.Dense(2, activation="softmax")(x)

model = keras.Model(inputs=inputs, outputs=outputs)


model.compile(
    optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
)
history = model.fit(
    x_train, y_train, batch_size=32, epochs=2, validation_data=(x_val, y_val)
)
"""[1:]

# keras-io guides/transfer_learning.py (its Keras 3 version): its Setup cell and the code
# cells of "An end-to-end example: fine-tuning an image classification model on a cats vs.
# dogs dataset", in order (the guide's earlier cells show the `trainable` API on small
# Dense models, apart from this flow, and are left out).
TRANSFER_LEARNING = r"""
import numpy as np
import keras
from keras import layers
import tensorflow_datasets as tfds
import matplotlib.pyplot as plt

tfds.disable_progress_bar()

train_ds, validation_ds, test_ds = tfds.load(
    "cats_vs_dogs",
    # Reserve 10% for validation and 10% for test
    split=["train[:40%]", "train[40%:50%]", "train[50%:60%]"],
    as_supervised=True,  # Include labels
)

print(f"Number of training samples: {train_ds.cardinality()}")
print(f"Number of validation samples: {validation_ds.cardinality()}")
print(f"Number of test samples: {test_ds.cardinality()}")

plt.figure(figsize=(10, 10))
for i, (image, label) in enumerate(train_ds.take(9)):
    ax = plt.subplot(3, 3, i + 1)
    plt.imshow(image)
    plt.title(int(label))
    plt.axis("off")

resize_fn = keras.layers.Resizing(150, 150)

train_ds = train_ds.map(lambda x, y: (resize_fn(x), y))
validation_ds = validation_ds.map(lambda x, y: (resize_fn(x), y))
test_ds = test_ds.map(lambda x, y: (resize_fn(x), y))

augmentation_layers = [
    layers.RandomFlip("horizontal"),
    layers.RandomRotation(0.1),
]


def data_augmentation(x):
    for layer in augmentation_layers:
        x = layer(x)
    return x


train_ds = train_ds.map(lambda x, y: (data_augmentation(x), y))

from tensorflow import data as tf_data

batch_size = 64

train_ds = train_ds.batch(batch_size).prefetch(tf_data.AUTOTUNE).cache()
validation_ds = (
    validation_ds.batch(batch_size).prefetch(tf_data.AUTOTUNE).cache()
)
test_ds = test_ds.batch(batch_size).prefetch(tf_data.AUTOTUNE).cache()

for images, labels in train_ds.take(1):
    plt.figure(figsize=(10, 10))
    first_image = images[0]
    for i in range(9):
        ax = plt.subplot(3, 3, i + 1)
        augmented_image = data_augmentation(np.expand_dims(first_image, 0))
        plt.imshow(np.array(augmented_image[0]).astype("int32"))
        plt.title(int(labels[0]))
        plt.axis("off")

base_model = keras.applications.Xception(
    weights="imagenet",  # Load weights pre-trained on ImageNet.
    input_shape=(150, 150, 3),
    include_top=False,
)  # Do not include the ImageNet classifier at the top.

# Freeze the base_model
base_model.trainable = False

# Create new model on top
inputs = keras.Input(shape=(150, 150, 3))

# Pre-trained Xception weights requires that input be scaled
# from (0, 255) to a range of (-1., +1.), the rescaling layer
# outputs: `(inputs * scale) + offset`
scale_layer = keras.layers.Rescaling(scale=1 / 127.5, offset=-1)
x = scale_layer(inputs)

# The base model contains batchnorm layers. We want to keep them in inference mode
# when we unfreeze the base model for fine-tuning, so we make sure that the
# base_model is running in inference mode here.
x = base_model(x, training=False)
x = keras.layers.GlobalAveragePooling2D()(x)
x = keras.layers.Dropout(0.2)(x)  # Regularize with dropout
outputs = keras.layers.Dense(1)(x)
model = keras.Model(inputs, outputs)

model.summary(show_trainable=True)

model.compile(
    optimizer=keras.optimizers.Adam(),
    loss=keras.losses.BinaryCrossentropy(from_logits=True),
    metrics=[keras.metrics.BinaryAccuracy()],
)

epochs = 2
print("Fitting the top layer of the model")
model.fit(train_ds, epochs=epochs, validation_data=validation_ds)

# Unfreeze the base_model. Note that it keeps running in inference mode
# since we passed `training=False` when calling it. This means that
# the batchnorm layers will not update their batch statistics.
# This prevents the batchnorm layers from undoing all the training
# we've done so far.
base_model.trainable = True
model.summary(show_trainable=True)

model.compile(
    optimizer=keras.optimizers.Adam(1e-5),  # Low learning rate
    loss=keras.losses.BinaryCrossentropy(from_logits=True),
    metrics=[keras.metrics.BinaryAccuracy()],
)

epochs = 1
print("Fitting the end-to-end model")
model.fit(train_ds, epochs=epochs, validation_data=validation_ds)

print("Test dataset evaluation")
model.evaluate(test_ds)
"""[1:]

# -- the page: diffs, edits ----------------------------------------------------------------


@dataclass(frozen=True)
class Hunk:
    old: list[str]
    new: list[str]
    edits: int  # runs of consecutive changed lines
    removed: int
    added: int


def section(anchor: str) -> str:
    """The text of the page's section whose heading carries `{ #anchor }`."""
    page = DOC.read_text(encoding="utf-8")
    found = re.search(rf"^## [^\n]*\{{ #{anchor} \}}\n(.*?)(?=^## |\Z)", page, re.M | re.S)
    assert found, f"docs/keras-io-examples.md has no section {{ #{anchor} }}"
    return found.group(1)


def parse_diff(text: str) -> list[Hunk]:
    """The hunks of a diff whose `@@ ... @@` headers carry no line numbers (a section name).

    A line is context (` `, or empty: an empty context line), removed (`-`) or added
    (`+`); the `---` / `+++` lines before the first hunk name the two files.
    """
    hunks: list[Hunk] = []
    lines = text.splitlines()
    while lines and not lines[0].startswith("@@"):
        assert lines[0].startswith(("---", "+++")), f"not a diff header: {lines[0]!r}"
        lines.pop(0)
    body: list[str] | None = None
    for line in [*lines, "@@ end @@"]:
        if line.startswith("@@"):
            if body is not None:
                hunks.append(_hunk(body))
            body = []
            continue
        assert line[:1] in ("", " ", "-", "+"), f"not a diff line: {line!r}"
        body.append(line or " ")
    return hunks


def _hunk(body: list[str]) -> Hunk:
    old = [line[1:] for line in body if line[0] in " -"]
    new = [line[1:] for line in body if line[0] in " +"]
    kinds = "".join("c" if line[0] == " " else "e" for line in body)
    assert old, "a hunk must show the lines it replaces or some context to find its place"
    removed = sum(1 for line in body if line[0] == "-")
    return Hunk(old, new, len(re.findall("e+", kinds)), removed, len(body) - len(old))


def apply_diff(text: str, hunks: list[Hunk]) -> str:
    """`text` with every hunk applied; each hunk's old lines occur exactly once, in order."""
    lines = text.splitlines()
    done = 0
    for hunk in hunks:
        size = len(hunk.old)
        places = [i for i in range(len(lines) - size + 1) if lines[i : i + size] == hunk.old]
        assert len(places) == 1, (
            f"a hunk's lines occur {len(places)} times in the original, not once:\n"
            + "\n".join(hunk.old)
        )
        assert places[0] >= done, "the hunks are not in the original's order"
        lines[places[0] : places[0] + size] = hunk.new
        done = places[0] + len(hunk.new)
    return "\n".join(lines) + "\n"


def substitute(text: str, replacements: list[tuple[str, str]], what: str) -> str:
    for old, new in replacements:
        assert old in text, f"the {what} script has no {old!r} to shrink"
        text = text.replace(old, new)
    return text


# -- the generated data, in each example's format ------------------------------------------

PALETTE = [
    [r, g, b] for r in (30, 90, 150, 210) for g in (30, 90, 150, 210) for b in (30, 90, 150, 210)
]


def pet_images(root: Path) -> None:
    """`PetImages/{Cat,Dog}/N.jpg`: 23 + 22 JPEGs (JFIF) of one color each, with noise, of
    several sizes (`Cat/6779.jpg`, the one the example predicts, among them), and one file
    without the JFIF header, which the example's own filter deletes."""
    from PIL import Image

    rng = np.random.default_rng(7)
    for index in range(45):
        folder = root / "PetImages" / ("Cat" if index < 23 else "Dog")
        folder.mkdir(parents=True, exist_ok=True)
        height, width = (int(v) for v in rng.integers(20, 41, 2))
        noise = rng.integers(-6, 7, (height, width, 3))
        pixels = np.clip(np.asarray(PALETTE[index]) + noise, 0, 255).astype("uint8")
        name = "6779" if index == 0 else str(100 + index)
        Image.fromarray(pixels).save(folder / f"{name}.jpg", quality=95)
    (root / "PetImages" / "Dog" / "666.jpg").write_bytes(b"\x00 not an image")


WORDS = "good bad great awful plot acting movie film scene story boring brilliant".split()


def imdb_folders(root: Path) -> None:
    """`aclImdb/{train,test}/{pos,neg}/N_R.txt`: 50 + 50 training and 10 + 10 test reviews,
    each unique, with the `<br />` tags and punctuation the example's standardizer removes."""
    rng = np.random.default_rng(8)
    for split, count in (("train", 50), ("test", 10)):
        for label in ("pos", "neg"):
            folder = root / "aclImdb" / split / label
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                words = rng.choice(WORDS, int(rng.integers(5, 40)))
                text = f"Review {split} {label} {i}: " + " ".join(words)
                text = text.replace(" the ", " <br /><br />The ") + ("!" if i % 2 else ".")
                (folder / f"{i}_{7 if label == 'pos' else 2}.txt").write_text(text)


def heart_csv(root: Path) -> None:
    """`heart.csv`: 100 patients in the columns of the example's file; every category of
    the example's inference sample occurs (its FeatureSpace has no out-of-vocabulary
    index), and the split by `dataframe.sample` leaves each in the training rows."""
    rng = np.random.default_rng(9)
    columns = ["age", "sex", "cp", "trestbps", "chol", "fbs", "restecg", "thalach"]
    columns += ["exang", "oldpeak", "slope", "ca", "thal", "target"]
    with (root / "heart.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for i in range(100):
            writer.writerow(
                [
                    int(rng.integers(29, 78)), i % 2, i % 5, int(rng.integers(94, 200)),
                    int(rng.integers(126, 400)), (i // 2) % 2, i % 3,
                    int(rng.integers(71, 202)), (i // 3) % 2, round(float(rng.uniform(0, 6)), 1),
                    i % 3 + 1, i % 4, ("fixed", "normal", "reversible")[i % 3],
                    int(rng.integers(0, 2)),
                ]
            )  # fmt: skip


def ford_a(root: Path) -> None:
    """`FordA_TRAIN.tsv` and `FordA_TEST.tsv`: 50 and 20 series of 40 steps, the label
    (-1 or 1) in the first column, as the UCR files."""
    rng = np.random.default_rng(10)
    for name, count in (("FordA_TRAIN.tsv", 50), ("FordA_TEST.tsv", 20)):
        labels = np.where(np.arange(count) % 2, 1.0, -1.0)
        steps = np.sin(np.linspace(0, 6, 40))[None, :] * labels[:, None]
        series = steps + rng.normal(0, 0.5, (count, 40))
        np.savetxt(root / name, np.column_stack([labels, series]), delimiter="\t")


def imdb_arrays(root: Path) -> None:
    """`imdb.npz`: 70 training and 20 test reviews as word indices below 20000, of 10 to
    250 words (padded or cut to the example's 200), for `keras.datasets.imdb.load_data`."""
    rng = np.random.default_rng(11)
    arrays = {}
    for name, count in (("train", 70), ("test", 20)):
        lengths = rng.integers(10, 251, count)
        labels = np.arange(count) % 2
        flat = [
            rng.integers(1 + 500 * label, 5000 + 500 * label, n)
            for n, label in zip(lengths, labels)
        ]
        arrays[f"x_{name}_flat"] = np.concatenate(flat).astype("int64")
        arrays[f"x_{name}_lengths"] = lengths
        arrays[f"y_{name}"] = labels.astype("int64")
    np.savez(root / "imdb.npz", **arrays)


def cats_vs_dogs(root: Path) -> None:
    """`cats_vs_dogs/NNNN_L.png`: 60 PNGs of one color each (a color of `PALETTE` per image),
    with noise, of sizes from 20 to 48 pixels, label L 0 (cat) or 1 (dog), read by the
    child's `tfds.load` stand-in as TFDS' `cats_vs_dogs` (uint8 images of their own sizes,
    int64 labels): the guide's splits are 24 training, 6 validation and 6 test images."""
    from PIL import Image

    rng = np.random.default_rng(12)
    folder = root / "cats_vs_dogs"
    folder.mkdir(parents=True)
    for index in range(60):
        height, width = (int(v) for v in rng.integers(20, 49, 2))
        noise = rng.integers(-6, 7, (height, width, 3))
        pixels = np.clip(np.asarray(PALETTE[index]) + noise, 0, 255).astype("uint8")
        Image.fromarray(pixels).save(folder / f"{index:04d}_{index % 2}.png")


# -- the examples --------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    anchor: str  # the page's section: `## ... { #anchor }`
    original: str
    data: object  # writes the example's files into a folder
    shrink: list[tuple[str, str]]  # in both scripts: (text, replacement)
    raw: str | None = None  # compare the samples before the example's own vectorizing map
    validation_order: str = "ordered"  # or "multiset": the original shuffles them
    train_identity: str = "exact"  # or "color": augmented images, by their mean color
    custom_objects: list[str] = field(default_factory=list)
    after_fit: tuple[tuple[str, list[int] | None], ...] = ()  # the script's own calls
    fits: int = 1  # the script's fit() calls
    kill_at: tuple[int, int, int] = (0, 1, 0)  # in the last fit(): fit, epoch, batch (mid-epoch)


# In the adopted script only: a checkpoint after every step (the page writes 100).
ADOPTED_SHRINK = [("save_freq=100", "save_freq=1")]

EXAMPLES = {
    "image-classification": Example(
        "image-classification",
        IMAGE_CLASSIFICATION,
        pet_images,
        [
            ("image_size = (180, 180)", "image_size = (24, 24)"),
            ("batch_size = 128", "batch_size = 10"),  # the plots show 9 images of a batch
            ("epochs = 25", "epochs = 2"),
            # The network: the first of its three residual blocks, every layer 8 to 16
            # times narrower (each layer kind of the example stays; tracing the training
            # step on 2 replicas costs by the layer, the checkpoints by the weight).
            ("layers.Conv2D(128, 3, strides=2", "layers.Conv2D(16, 3, strides=2"),
            ("for size in [256, 512, 728]:", "for size in [32]:"),
            ("layers.SeparableConv2D(1024, 3", "layers.SeparableConv2D(64, 3"),
        ],
        train_identity="color",
        after_fit=(("predict", [1, 1]),),
    ),
    "text-classification": Example(
        "text-classification",
        TEXT_CLASSIFICATION,
        imdb_folders,
        [
            ("max_features = 20000", "max_features = 2000"),
            ("sequence_length = 500", "sequence_length = 64"),
            ("epochs = 3", "epochs = 2"),
        ],
        raw="string",
        validation_order="multiset",  # Keras' loader shuffles subset="validation"
        after_fit=(("evaluate", None), ("evaluate", None)),
    ),
    "structured-data": Example(
        "structured-data",
        STRUCTURED_DATA,
        heart_csv,
        [
            (
                '"http://storage.googleapis.com/download.tensorflow.org/data/heart.csv"',
                '"heart.csv"',
            ),
            ("epochs=20,", "epochs=2,"),
        ],  # fmt: skip
        raw="dict",
        validation_order="multiset",  # the example shuffles its validation rows too
        after_fit=(("predict", [1, 1]),),
    ),
    "timeseries-classification": Example(
        "timeseries-classification",
        TIMESERIES,
        ford_a,
        [
            (
                'root_url = "https://raw.githubusercontent.com/hfawaz/cd-diagram/master/FordA/"',
                'root_url = ""',
            ),
            ("epochs = 500", "epochs = 2"),
        ],  # fmt: skip
        after_fit=(("evaluate", None),),
    ),
    "text-classification-transformer": Example(
        "text-classification-transformer",
        TRANSFORMER,
        imdb_arrays,
        [("keras.datasets.imdb.load_data(", "kmk_test_imdb_load_data(")],
        custom_objects=["TransformerBlock", "TokenAndPositionEmbedding"],
    ),
    "transfer-learning": Example(
        "transfer-learning",
        TRANSFER_LEARNING,
        cats_vs_dogs,
        [
            # The base: MobileNetV2 at its narrowest, untrained, for 32x32 images, cut after
            # its first residual block: every kind of layer of MobileNetV2 stays (Conv2D,
            # DepthwiseConv2D, BatchNormalization, ReLU6, ZeroPadding2D, Add), 27 trainable
            # weights (4096 numbers) instead of its 156 (Xception's 154): tracing the
            # fine-tuning step on 2 replicas costs by the layer.
            ("keras.applications.Xception(", "keras.applications.MobileNetV2(alpha=0.35,"),
            ('weights="imagenet",', "weights=None,"),
            ("(150, 150, 3)", "(32, 32, 3)"),
            (
                ")  # Do not include the ImageNet classifier at the top.",
                ")  # Do not include the ImageNet classifier at the top.\n"
                "base_model = keras.Model(\n"
                '    base_model.input, base_model.get_layer("block_2_add").output\n'
                ")",
            ),
            ("Resizing(150, 150)", "Resizing(32, 32)"),
            ("batch_size = 64", "batch_size = 10"),  # 24 images: batches of 10, 10 and 4
        ],  # fmt: skip
        train_identity="color",  # augmented images, by their mean color
        after_fit=(("evaluate", None),),
        fits=2,
        kill_at=(1, 0, 0),  # the fine-tuning fit, after the second compile: its first step
    ),
}


def hunks_of(example: Example) -> list[Hunk]:
    block = re.search(r"^```diff\n(.*?)^```$", section(example.anchor), re.M | re.S)
    assert block, f"no ```diff block in the section {{ #{example.anchor} }}"
    return parse_diff(block.group(1))


def adopted(example: Example) -> tuple[str, int]:
    """The example with the page's diff applied, and the diff's number of edits."""
    hunks = hunks_of(example)
    return apply_diff(example.original, hunks), sum(h.edits for h in hunks)


def stated_edits(example: Example) -> int:
    found = re.findall(r"\*\*(\d+) edits\*\*", section(example.anchor))
    assert len(found) == 1, f"the section {{ #{example.anchor} }} states no single **N edits**"
    return int(found[0])


def table_row(example: Example) -> tuple[int, int, int]:
    """(edits, lines removed, lines added) in the page's table of the five examples."""
    page = DOC.read_text(encoding="utf-8")
    found = re.findall(rf"\(#{example.anchor}\) \| (\d+) \| (\d+) / (\d+) \|", page)
    assert len(found) == 1, f"the page's table has no single row for #{example.anchor}"
    edits, removed, added = (int(v) for v in found[0])
    return edits, removed, added


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_pages_diff_applies_to_the_example_in_at_most_10_edits(name: str) -> None:
    example = EXAMPLES[name]
    script, edits = adopted(example)
    assert edits <= MAX_EDITS, f"{name}: {edits} edits"
    assert edits == stated_edits(example), f"{name}: the diff has {edits} edits"
    hunks = hunks_of(example)
    lines = (sum(h.removed for h in hunks), sum(h.added for h in hunks))
    assert table_row(example) == (edits, *lines), f"{name}: {edits} edits, lines {lines}"
    assert "import keras_mirror_kit as kmk" in script and "SyncedCheckpoint(" in script
    compile(script, f"{name}.py", "exec")  # it parses


# -- running them --------------------------------------------------------------------------


def _run(mode: str, spec: Path, timeout: float, replicas: int = 2):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env["KMK_SIMULATE_REPLICAS"] = str(replicas)
    env.pop("TF_CONFIG", None)
    return forkserver.run(
        [sys.executable, "-m", "tests.keras_io_child", mode, str(spec)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _markers(stdout: str) -> list[str]:
    return re.findall(r"^KMK_IO_STEP ((?:fit=\d+ )?epoch=\d+ batch=\d+) step=\d+$", stdout, re.M)


def _marker(fit: int, epoch: int, batch: int) -> str:
    return f"{f'fit={fit} ' if fit else ''}epoch={epoch} batch={batch}"


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_adopted_example_resumes_exactly_on_the_examples_data(
    tmp_path: Path, name: str
) -> None:
    example = EXAMPLES[name]
    assert example.kill_at[0] == example.fits - 1  # the kill is in the script's last fit()
    script, edits = adopted(example)
    assert edits <= MAX_EDITS  # (a)
    original = substitute(example.original, example.shrink, "original")
    script = substitute(substitute(script, example.shrink, "adopted"), ADOPTED_SHRINK, "adopted")
    data = tmp_path / "data"
    data.mkdir()
    example.data(data)
    (tmp_path / "original.py").write_text(original, encoding="utf-8")
    (tmp_path / "adopted.py").write_text(script, encoding="utf-8")
    spec = {
        "original": str(tmp_path / "original.py"),
        "adopted": str(tmp_path / "adopted.py"),
        "data": str(data),
        "work": str(tmp_path / "work"),
        "raw": example.raw,
        "validation_order": example.validation_order,
        "train_identity": example.train_identity,
        "palette": PALETTE,
        "custom_objects": example.custom_objects,
        "kill_at": list(example.kill_at),
        "fits": example.fits,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec), encoding="utf-8")

    killed = _run("kill", tmp_path / "spec.json", 600)
    assert killed.returncode == -signal.SIGKILL, (
        f"rc={killed.returncode}\n{killed.stdout[-3000:]}\n{killed.stderr[-6000:]}"
    )
    assert _markers(killed.stdout)[-1] == _marker(*example.kill_at), killed.stdout[-3000:]

    finished = _run("finish", tmp_path / "spec.json", 1200)
    assert finished.returncode == 0, (
        f"rc={finished.returncode}\n{finished.stdout[-3000:]}\n{finished.stderr[-8000:]}"
    )
    result = last_json(finished)

    # (d) killed after a step in the middle of an epoch: resumed there, and no step twice.
    resume = result["resume"]
    fit, epoch, batch = example.kill_at
    planned = resume["reference_fits"][fit]
    steps, per_epoch = planned["trained"], planned["trained"] // planned["epochs"]
    assert per_epoch >= 2 and per_epoch * planned["epochs"] == steps, resume
    assert steps == planned["iterations"] == resume["reference_iterations"], resume
    assert batch + 1 < per_epoch, resume  # the kill leaves the epoch part-way
    killed_at = epoch * per_epoch + batch + 1  # the steps the killed fit() had taken
    # The rerun script's fit() calls before the killed one find its checkpoint, written by
    # a later fit() of the script, and train nothing (docs/checkpointing.md); the killed
    # one restores it and trains only the steps after it.
    resumed_fits = resume["resumed_fits"]
    assert [f["trained"] for f in resumed_fits[:fit]] == [0] * fit, resume
    assert resumed_fits[fit]["restored_step"] == resume["restored_step"] == killed_at, resume
    assert resume["trained"] == steps - killed_at == resumed_fits[fit]["trained"], resume
    assert resume["iterations"] == steps and resume["val_logs"], resume
    # Bit for bit: the same kernels on the same data in the same order on the same two
    # CPU replicas (a fixed reduction order), from the same restored state.
    assert resume["same_shapes"] and resume["max_diff"] == 0.0, resume
    # Every replica's copy (evaluation reads each replica's own), and so the validation
    # of the resumed epoch, which the example's callbacks act on.
    assert set(resume["copies"]) == {2} and resume["max_copy_diff"] == 0.0, resume
    assert all(ref == res for ref, res in resume["val_logs"].values()), resume

    # (b) the validation samples fit evaluates are the example's own.
    validation = result["validation"]
    assert validation["original"] > 0 and validation["equal"], validation
    # (c) one epoch trains on each of the example's training samples, once.
    training = result["training"]
    assert training["equal"] and training["unidentified"] == 0, training
    assert training["distinct"] == training["adopted"] == training["original"] > 0, training

    # (e) the example's own steps after fit, and the model saved and loaded back.
    after = result["after_fit"]
    assert [call["method"] for call in after] == [m for m, _ in example.after_fit], after
    for call, (_, shape) in zip(after, example.after_fit):
        assert call["finite"] and (shape is None or call["shape"] == shape), after
    saved = result["saved"]
    assert saved["weights_equal"], saved
    # One sample: the replica's device runs the same CPU kernels as the loaded model's.
    assert saved["predict_diff"] == 0.0, saved
    # The fitted model's evaluation is fit's last validation (after its last step), the
    # loaded model's one evaluate() of the same samples. On 2 replicas evaluate() sums each
    # replica's part of the batch and adds the two; on one device it is one float32 sum:
    # the same terms in another order (measured: relative 1e-7).
    evaluated, loaded = saved["evaluated"], saved["loaded_evaluated"]
    assert evaluated and sorted(evaluated) == sorted(loaded), saved
    names = sorted(evaluated)
    np.testing.assert_allclose(
        [evaluated[n] for n in names], [loaded[n] for n in names], rtol=1e-6, err_msg=str(saved)
    )


# -- the fine-tuning guide on 1 and on 2 replicas ------------------------------------------

# Both runs without Dropout: its masks are drawn per replica, so 2 replicas drop other
# features than 1 (a difference the kit names and expects: `random_layers` in
# docs/troubleshooting.md); the augmentation stays (the kit draws it for the global batch).
NO_DROPOUT = [("keras.layers.Dropout(0.2)", "keras.layers.Dropout(0.0)")]
# The guide's rates for Adam; SGD at rates that move the weights as far (the guide's 1e-5
# would leave the base where it started, whatever the replicas did).
OPTIMIZERS = {
    "adam": ([], 2e-4),
    "sgd": (
        [
            ("keras.optimizers.Adam()", "keras.optimizers.SGD(0.1)"),
            ("keras.optimizers.Adam(1e-5)", "keras.optimizers.SGD(0.01)"),
        ],
        1e-6,
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_the_fine_tuning_guide_trains_on_two_replicas_as_on_one(
    tmp_path: Path, optimizer: str
) -> None:
    """The adopted guide, both compiles, on 1 and on 2 replicas: the same weights at the end,
    within 1e-6 with SGD and 2e-4 with Adam (its step divides by the root of the squared
    gradient, which turns the replicas' last-bit differences into larger ones where the
    gradient is tiny)."""
    example = EXAMPLES["transfer-learning"]
    swap, tolerance = OPTIMIZERS[optimizer]
    script = substitute(adopted(example)[0], example.shrink + NO_DROPOUT + swap, "adopted")
    data = tmp_path / "data"
    data.mkdir()
    example.data(data)
    (tmp_path / "adopted.py").write_text(script, encoding="utf-8")
    weights = {}
    for replicas in (1, 2):
        work = tmp_path / f"replicas-{replicas}"
        spec = {
            "adopted": str(tmp_path / "adopted.py"),
            "data": str(data),
            "work": str(work),
            "fits": example.fits,
            "weights_out": str(tmp_path / f"weights-{replicas}.npz"),
        }
        (tmp_path / f"spec-{replicas}.json").write_text(json.dumps(spec), encoding="utf-8")
        done = _run("train", tmp_path / f"spec-{replicas}.json", 600, replicas=replicas)
        assert done.returncode == 0, f"rc={done.returncode}\n{done.stderr[-8000:]}"
        fits = last_json(done)["fits"]
        # Both fits trained every step, each with its own optimizer (the second compile's).
        assert [(f["trained"], f["iterations"]) for f in fits] == [(6, 6), (3, 3)], fits
        with np.load(spec["weights_out"]) as saved:
            weights[replicas] = {key: saved[key] for key in saved.files}
    one, two = weights[1], weights[2]
    assert sorted(one) == sorted(two), (sorted(one), sorted(two))
    assert all(np.array_equal(one[k], two[k]) for k in one if k.startswith("fit0_start_"))

    def gap(a: dict, key_a: str, b: dict, key_b: str) -> float:
        keys = sorted(k for k in a if k.startswith(key_a + "_"))
        pairs = [(a[k], b[k.replace(key_a, key_b, 1)]) for k in keys]
        return max(float(np.max(np.abs(x - y))) for x, y in pairs)

    replicas = gap(one, "fit1_end", two, "fit1_end")  # 1 against 2 replicas, at the end
    moved = gap(one, "fit1_end", one, "fit0_start")  # by both fits
    fine_tuned = gap(one, "fit1_end", one, "fit1_start")  # by the second fit
    print(
        f"KMK_IO_REPLICAS {optimizer}: max |1 - 2 replicas| {replicas:.3g}; weights moved "
        f"{moved:.3g}, {fine_tuned:.3g} by the fine-tuning fit"
    )
    assert replicas <= tolerance, (optimizer, replicas)
    assert moved > 10 * tolerance, (optimizer, moved)  # the runs did train
