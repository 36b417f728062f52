"""``gpulock evict`` and ``gpulock tenants``: the commands about the models held in VRAM.

``evict`` asks the owner of a resident model (a library resident, or a tenant's model server)
to unload it at a safe point; ``tenants`` asks every configured model server what it holds.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict

from gpulock.cli_kit import EX_ERROR, EX_OK, check_gpu, settings_of
from gpulock.core.errors import GpulockError


def cmd_evict(args: argparse.Namespace) -> int:
    from gpulock.core.errors import known_hint
    from gpulock.residents import eviction, registry

    settings = settings_of(args)  # a tenant's models need no state folder
    if args.gpu is not None:
        check_gpu(settings, args.gpu)
    matches = eviction.find(settings, args.target, gpu=args.gpu, tenant=args.tenant)
    if not matches:
        known = sorted({r.id if r.tenant else r.name for r in registry.all_records(settings)})
        raise GpulockError(
            f"no resident model {args.target!r}"
            + (f" on gpu{args.gpu}" if args.gpu is not None else "")
            + (f" in tenant {args.tenant}" if args.tenant is not None else ""),
            hint=(
                known_hint(args.target, known, "resident models") if known else "none is registered"
            ),
        )
    results = [
        eviction.evict(settings, r, force=args.force, timeout_s=args.timeout) for r in matches
    ]
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results]}, indent=2))
    else:
        for r in results:
            pid = f", pid {r.pid}" if r.pid is not None else ""  # a tenant's server: unknown
            print(f"{r.name} ({r.id}{pid}, gpu{r.gpu}): {r.outcome}: {r.detail}")
    return EX_OK if all(r.ok for r in results) else EX_ERROR


def cmd_tenants(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    if not settings.config.tenants:
        if args.json:
            print(json.dumps({"tenants": []}, indent=2))
        else:
            print("no tenants configured (add a 'tenants:' list to the config; see the README)")
        return EX_OK
    from gpulock.residents import registry
    from gpulock.tenants import survey

    entries = registry.tenant_entries(settings)
    print(json.dumps({"tenants": entries}, indent=2) if args.json else survey.render(entries))
    return EX_OK


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "evict": cmd_evict,
    "tenants": cmd_tenants,
}
