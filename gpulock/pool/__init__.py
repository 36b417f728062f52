"""``gpulock pool``: a batch that runs as many workers as the GPU's free memory admits.

``supervisor`` runs the workers, ``policy`` holds its rules (pure), ``record`` is what
``gpulock status`` reads, ``cli`` is the command.  See docs/pool.md.
"""
