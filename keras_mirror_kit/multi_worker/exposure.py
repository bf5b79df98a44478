"""What a cluster exposes: each worker's TensorFlow server listens on all its interfaces.

TensorFlow binds the server of every task to `0.0.0.0:PORT` whatever host `TF_CONFIG`
names, and the server runs any graph it is sent, without authentication or encryption.
`keras-mirror-kit launch` isolates a single-host cluster (or warns itself, and says which in
`KMK_LAUNCH_NETWORK`); every other cluster (several hosts, Slurm, Kubernetes, `TF_CONFIG`
written by hand) gets one WARNING from its chief, naming the ports.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from keras_mirror_kit.multi_worker import NETWORK_ENV, SECURITY_DOCS_URL

logger = logging.getLogger("keras_mirror_kit")

_SHOWN = 8  # addresses named in the message; the rest are counted
_warned = False


def warn_exposed_servers(cluster: Mapping[str, Sequence[str]], chief: bool) -> bool:
    """Logs, once per process and on the chief only, which ports listen on all interfaces.

    Returns whether it logged.
    """
    global _warned
    if not chief or _warned or os.environ.get(NETWORK_ENV, "").strip():
        return False
    _warned = True
    addresses = [a for job in ("chief", "worker") for a in cluster.get(job, ())]
    shown = ", ".join(addresses[:_SHOWN])
    if len(addresses) > _SHOWN:
        shown += f" and {len(addresses) - _SHOWN} more"
    logger.warning(
        "keras-mirror-kit: the TensorFlow server of each of the %d tasks of this cluster "
        "listens on all network interfaces of its host (TensorFlow binds 0.0.0.0 on the port "
        "of its address: %s), without authentication or encryption, and runs whatever "
        "computation it is sent: anyone who can reach one of these ports can run code as "
        "that task's user. Keep the cluster on a private network, or behind a firewall that "
        "admits only its hosts; see %s",
        len(addresses),
        shown,
        SECURITY_DOCS_URL,
    )
    return True
