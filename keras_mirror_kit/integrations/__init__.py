"""Optional integrations with third-party tools.

Each integration lives in its own module and needs its own extra, so importing this
package costs nothing and pulls in no optional dependency:

- `keras_mirror_kit.integrations.wandb`: `WandbLogger`, a Keras callback that logs a
  distributed run to Weights & Biases (`pip install "keras-mirror-kit[wandb]"`).
"""
