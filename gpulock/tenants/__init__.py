"""Tenants: the model servers that really hold the GPU, as residents gpulock sees and evicts.

One adapter per ``kind`` (``ollama``, ``llama_server``, ``llama_swap``, ``vllm``, ``comfyui``,
``localai``, ``command``), behind the small interface of ``base.Adapter`` (list, unload, load,
health), stdlib HTTP only (``http``).  ``survey`` asks every tenant at once what it holds;
``usage`` remembers last uses no server reports.  The package sees nothing of resident records:
``gpulock.residents`` turns its listings into residents and evicts tenants' models; the
``tenants:`` config list is validated in ``gpulock.core.tenantspec``.

For code built on gpulock (``gpulock serve``, the router) the entry points are::

    from gpulock.tenants.survey import adapter_for, find_spec, survey
    spec = find_spec(settings, "ollama")            # TenantError listing the known ones
    adapter = adapter_for(spec, settings)           # base.Adapter: list/unload/load/health
    adapter.client.post("/v1/chat/completions", body)  # the tenant's own API, key attached

This package is imported only when the config has tenants: ``import gpulock`` and
``gpulock run`` never load it otherwise.
"""
