"""Several GPU hosts as one pool, coordinated through Redis (config: ``cluster:``).

Each GPU's FIFO line stays on its host; what the hosts share is their reports (``report``),
kept in Redis under the keys of ``keys``, published by ``gpulock serve``'s heartbeat
(``heartbeat``) through the one door to Redis (``store``).  ``place`` decides where a gpu
candidate runs.  Built on gpulock's public face and ``gpulock.core`` only; the ``redis``
client (the ``cluster`` extra) is imported by ``store`` on its first call, never by
``import gpulock`` or ``gpulock run``.  See docs/cluster.md.
"""
