"""``gpulock pool``: a batch that runs as many workers as the GPU's free memory admits.

``supervisor`` runs the workers, ``policy`` holds its rules (pure), ``record`` is what
``gpulock status`` reads; the command is ``gpulock.cli_line``'s (its flags: ``gpulock.cli``).
See docs/pool.md.
"""

# What each worker is told (besides what ``gpulock run`` sets): here, so that an agent can ask
# whether it is a pool's worker without importing the supervisor (asyncio and the lock).
ENV_WORKER = "GPULOCK_POOL_WORKER"  # its index among the pool's workers
ENV_SIZE = "GPULOCK_POOL_SIZE"  # workers running when it started, itself included
