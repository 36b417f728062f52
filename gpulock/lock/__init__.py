"""The line in front of each GPU: tickets, the queue rule, the waiter, the lease.

``ticket`` (the versioned record) and ``queue`` (the pure FIFO rule) decide; ``queuedir`` keeps a
GPU's folder, ``seqfile`` the numbering and ``census`` every line at once; ``gpuset`` checks the
GPUs a ticket asks for; ``queued`` is a ticket in line, ``lines`` its place in each GPU's line and
the rule over them; ``waiter`` sleeps until the kernel says and ``hung`` deals with a holder past
its lease; ``lease`` takes and holds the GPU, ``inherit`` passes it down to ``gpulock run``'s
command; ``aiolock`` waits on an event loop; ``exitwait`` and ``sigwake`` wake waiters; ``repair``
is ``gpulock break``; ``prefetch`` warms a waiter's files.

The lock knows nothing of residents, tenants or eviction: making room before a grant is the
``room.Room`` its caller passes in (the public ``gpulock.acquire`` passes the residents' one).
Not a door: packages above gpulock take the lock through ``gpulock.acquire``/``acquire_async``
and read a line through ``gpulock.status``.
"""
