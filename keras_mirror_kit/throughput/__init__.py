"""Throughput: the arithmetic of samples/s and MFU, the FLOPs of a step, the hardware's peak.

As in Lightning's throughput utilities, the three pieces live together:

* `meter` (`ThroughputMeter`): samples/s, per replica, step time and scaling efficiency from
  a clock and step counts; no framework in it, tested with a fake clock;
* `flops` (`count_training_flops`): FLOPs per training sample, from the traced graph;
* `peaks`: the dense peak FLOP/s of GPUs by compute dtype, and a measured CPU roof.

`keras_mirror_kit.callbacks.ThroughputMonitor` is the thin Keras callback over them.
Importing this package imports no framework (`flops` imports TensorFlow when it is used).
"""
