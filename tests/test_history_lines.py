"""``gpulock history``'s human lines: nested fields (a governor's ``evidence``, a route's
``model``) read as ``key.sub=value`` with units, never as Python reprs (``{'model': ...}``)."""

from __future__ import annotations

import json

from cli_helpers import Cli


def test_nested_fields_read_as_dotted_keys_with_units(cli: Cli) -> None:
    assert cli.run("run", "--name", "warmup", "--", "true").code == 0  # makes the state folder
    events = [
        {
            "ts": 1795214087.5,
            "event": "escalate",
            "level": "reduce",
            "from_level": "normal",
            "reason": "vram_pressure 0.97 > 0.95 for 3 passes",
            "evidence": {"gpu0": {"used_bytes": 9 * 2**30, "frac": 0.97}, "psi_some": None},
        },
        {
            "ts": 1795214088.0,
            "event": "governor",
            "action": "evict",
            "outcome": "freed",
            "evidence": {"model": "qwen-7b", "idle_s": 720.0, "in_use": False},
            "tiers": ["gpu", "cpu"],
            "odd": [{"x": 1}],
        },
    ]
    with open(cli.state / "events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    r = cli.run("history", "--event", "escalate", "--event", "governor")
    assert r.code == 0, r.describe()
    escalate, governor = r.stdout.splitlines()
    assert "{'" not in r.stdout and "None" not in r.stdout, r.stdout
    assert escalate.endswith(
        "level=reduce from_level=normal reason=vram_pressure 0.97 > 0.95 for 3 passes "
        "evidence.gpu0.used_bytes=9.0 GiB evidence.gpu0.frac=0.97"
    ), escalate
    assert governor.endswith(
        "action=evict outcome=freed evidence.model=qwen-7b evidence.idle_s=12m00s "
        'evidence.in_use=false tiers=gpu,cpu odd=[{"x":1}]'
    ), governor
