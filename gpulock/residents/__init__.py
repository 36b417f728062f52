"""Every model resident in GPU memory, whoever holds it, and how it is asked to leave.

``registry`` keeps the records of library residents and is the one place that merges them with
the tenants' models; ``owner`` is the library side (``gpulock.resident``); ``eviction`` and
``tenant_evict`` ask owners and servers to unload and verify the memory came back; ``room`` makes
room before a grant for the lock; ``adapters`` unload torch and llama.cpp models; ``control`` is
the owners' socket.  A door for the packages above gpulock.
"""
