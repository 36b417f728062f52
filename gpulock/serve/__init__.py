"""``gpulock serve``: the OpenAI and Ollama HTTP APIs in front of every model of the route
table, where a request for a GPU model stands in the same per-GPU line as ``gpulock run``.

::

    client --HTTP--> gpulock.serve.app --(model -> task -> gpulock.router.choose)-->
    gpulock.serve.line (a ticket in gpuN's FIFO, via gpulock.acquire_async) -->
    gpulock.serve.engines (llama.cpp in this process, or an OpenAI-compatible server)

Importing this package is light; Starlette, uvicorn and httptools load when the server starts.
"""
