"""The ground floor: what every other room, and every package above gpulock, stands on.

Configuration (``config``, ``tenantspec``), the state folder (``state``, ``settings``), safe JSON,
identity and proof of a process, claims, the event log and log files, units, errors, devices,
API keys, the page cache, the governor's published level and the GGUF header reader.  Stdlib
and PyYAML only; it imports nothing else of gpulock.  A door: router, serve, governor and agents
may import any module here.
"""
