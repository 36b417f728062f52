"""Stand-ins for the model servers that cannot run here (no GPU, not in a reachable registry).

Each module follows one server's documented HTTP API, pitfalls included, and says at its top
which version's API it follows.  They are real HTTP servers on 127.0.0.1 (stdlib
``http.server`` in a thread), so the adapters talk to them exactly as to the real thing.
"""
