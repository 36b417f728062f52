"""``gpulock run --gpu any``, ``--gpu 0,2`` and ``--gpus N`` as a shell uses them (issue 28):
real ``gpulock`` processes on a simulated host of several GPUs."""

from __future__ import annotations

import json
import os
import signal
import sys

from cli_helpers import GPULOCK, Cli, assert_clean_error, error_lines, wait_until

SHOW = 'echo "$CUDA_VISIBLE_DEVICES|$CUDA_DEVICE_ORDER|$GPULOCK_GPUS|$GPULOCK_TICKET"'


def shown(out: str) -> tuple[str, str, str, str]:
    cuda, order, gpus, ticket = out.strip().split("|")
    return cuda, order, gpus, ticket


def test_any_runs_on_the_gpu_that_is_free(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB,24GiB"
    cli.hold("h0", gpu=0)
    cli.hold("h1", gpu=1)
    r = cli.run("run", "--gpu", "any", "--", "sh", "-c", SHOW)
    assert r.code == 0, r.describe()
    cuda, order, gpus, ticket = shown(r.stdout)
    assert (cuda, order, gpus) == ("2", "PCI_BUS_ID", "2")
    (acq,) = [e for e in cli.events("acquire") if e["name"] == "sh"]
    assert (acq["gpu"], acq["gpus"], acq["granted"]) == (2, [0, 1, 2], [2])
    assert ticket == f"2:{acq['ticket']}"


def test_two_gpus_at_once_in_order_and_in_nvml_numbering(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB,24GiB,24GiB"
    cli.hold("h1", gpu=1)
    env = cli.env(CUDA_DEVICE_ORDER="FASTEST_FIRST")  # CUDA's own order would put it elsewhere
    r = cli.run("run", "--gpus", "2", "--", "sh", "-c", SHOW, env=env)
    assert r.code == 0, r.describe()
    cuda, order, gpus, _ticket = shown(r.stdout)
    assert (cuda, order, gpus) == ("0,2", "PCI_BUS_ID", "0,2")
    (acq,) = [e for e in cli.events("acquire") if e["name"] == "sh"]
    assert (acq["gpus"], acq["gpu_set"], acq["granted"]) == (2, [0, 1, 2, 3], [0, 2])
    rel = [e for e in cli.events("release") if e["name"] == "sh"]
    assert rel and rel[0]["granted"] == [0, 2]
    mine = f"{acq['ticket']:012d}."
    for g in range(4):  # released: nothing of it left in any line
        assert not [f for f in cli.queue_files(g) if f.startswith(mine)], g


def test_a_set_of_gpus(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB,24GiB"
    cli.hold("h0", gpu=0)
    r = cli.run("run", "--gpu", "0,2", "--", "sh", "-c", SHOW)
    assert r.code == 0, r.describe()
    assert shown(r.stdout)[:3] == ("2", "PCI_BUS_ID", "2")


def test_default_gpu_any_in_the_config(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB"
    cfg = cli.root / "gpulock.yaml"
    cfg.write_text("default_gpu: any\n")
    env = cli.env(GPULOCK_CONFIG=str(cfg))
    cli.hold("h0", gpu=0)
    r = cli.run("run", "--", "sh", "-c", SHOW, env=env)
    assert r.code == 0, r.describe()
    assert shown(r.stdout)[0] == "1"


def test_a_nested_run_inside_a_two_gpu_run_is_covered_by_it(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB"
    inner = r'gpulock run --gpu 1 --timeout 5 -- sh -c "echo inner \$CUDA_VISIBLE_DEVICES"'
    r = cli.run("run", "--gpus", "2", "--", "sh", "-c", inner)
    assert r.code == 0, r.describe()
    assert r.stdout.strip() == "inner 1"
    assert len(cli.events("acquire")) == 1  # the inner run took no ticket of its own


def test_a_killed_two_gpu_run_frees_both_gpus(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB"
    m = cli.hold("m", "--gpus", "2", gpu="any")
    w0 = cli.start_run("w0", "--gpu", "0", cmd=["true"])
    w1 = cli.start_run("w1", "--gpu", "1", cmd=["true"])
    wait_until(lambda: len(cli.events("wait")) == 2, lambda: cli.describe())
    os.killpg(m.pid, signal.SIGKILL)  # gpulock run and its command, the claims' holders
    assert w0.wait() == 0 and w1.wait() == 0, w0.output() + w1.output()
    for g in (0, 1):
        assert not [f for f in cli.queue_files(g) if f.endswith((".ticket", ".fifo"))], g


def test_bad_gpu_sets_are_usage_errors(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB"
    r = cli.run("run", "--gpus", "3", "--", "true")
    assert_clean_error(r, 2)
    assert error_lines(r.stderr)[0] == (
        "error: 3 GPUs at once cannot be had: this machine has 2 (gpu0, gpu1)"
    )
    r = cli.run("run", "--gpu", "0,5", "--", "true")
    assert_clean_error(r, 2)
    assert "gpu5 does not exist" in r.stderr
    r = cli.run("run", "--gpu", "first", "--", "true")
    assert_clean_error(r, 2)
    assert "expected a GPU index like 0, a set like 0,2, or any, got 'first'" in r.stderr
    r = cli.run("run", "--gpu", "1", "--gpus", "2", "--", "true")
    assert_clean_error(r, 2)
    assert "a single GPU was named" in r.stderr
    r = cli.run("run", "--gpus", "0", "--", "true")
    assert_clean_error(r, 2)
    for g in (0, 1):
        assert not cli.queue_files(g)


def test_too_few_gpus_is_an_error_with_its_fields_in_python(cli: Cli) -> None:
    import pickle

    import pytest

    import gpulock
    from gpulock.core.errors import TooFewGpus

    with pytest.raises(TooFewGpus) as caught:
        gpulock.acquire(gpus=3, config=None, state_dir=cli.state, gpu=[0, 1])
    e = caught.value
    assert (e.count, e.gpus, e.exit_code) == (3, (0, 1), 2)
    assert "--gpus" in (e.hint or "")
    assert pickle.loads(pickle.dumps(e)).gpus == (0, 1)  # noqa: S301 - our own bytes
    assert not cli.state.exists() or not list(cli.state.glob("gpu*/*.ticket"))


def test_status_json_of_a_set_waiter_and_a_two_gpu_holder(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB"
    cli.hold("m", "--gpus", "2", gpu="any")
    cli.start([*GPULOCK, "run", "--name", "a", "--gpu", "any", "--", "true"], "a")
    wait_until(lambda: cli.events("wait", name="a"), lambda: cli.describe())
    snap = cli.status()
    for g in snap["gpus"]:
        (h,) = g["holders"]
        assert (h["name"], h["gpus"], h["gpu_set"], h["granted"]) == ("m", 2, [0, 1], [0, 1])
        assert g["waiters"] == []
    (line,) = snap["sets"]
    (w,) = line["waiters"]
    assert (line["gpus"], w["name"], w["gpus"], w["granted"]) == ([0, 1], "a", [0, 1], [])
    text = cli.run("status").stdout
    assert "holding gpus 0,1" in text and "gpus 0,1 (one line)  -  1 waiting" in text


def test_any_on_a_one_gpu_machine_is_exactly_a_pinned_ticket(cli: Cli) -> None:
    """One GPU: --gpu any is --gpu 0, the same ticket file (no set keys) and events."""
    cli.simulate = "24GiB"
    script = (
        "import json, os, sys; d = os.environ['GPULOCK_STATE_DIR'] + '/gpu0'; "
        "t = [n for n in os.listdir(d) if n.endswith('.ticket')][0]; "
        "print(json.dumps(sorted(json.load(open(os.path.join(d, t))))))"
    )
    r = cli.run("run", "--gpu", "any", "--", sys.executable, "-c", script)
    assert r.code == 0, r.describe()
    keys = set(json.loads(r.stdout))
    assert not keys & {"gpus", "count", "granted_gpus"}
    (acq,) = cli.events("acquire")
    assert acq["gpu"] == 0 and not {"gpus", "granted", "gpu_set"} & set(acq)
    r = cli.run("run", "--gpu", "any", "--", "sh", "-c", SHOW)
    assert shown(r.stdout)[:3] == ("0", "PCI_BUS_ID", "0")


def test_a_set_that_times_out_says_which_gpus_it_waited_for(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB"
    cli.hold("h0", gpu=0)
    cli.hold("h1", gpu=1)
    r = cli.run("run", "--gpu", "any", "--timeout", "0.5", "--", "true")
    assert r.code == 75, r.describe()
    assert error_lines(r.stderr)[0].startswith("error: any of gpus 0,1 busy after 0.")
    r = cli.run("run", "--gpus", "2", "--timeout", "0.5", "--", "true")
    assert r.code == 75 and "error: 2 of gpus 0,1 busy after" in r.stderr, r.describe()


def test_break_stale_removes_a_dead_two_gpu_holder_once(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB"
    m = cli.hold("m", "--gpus", "2", gpu="any")
    (acq,) = cli.events("acquire", name="m")
    os.killpg(m.pid, signal.SIGKILL)
    m.wait()
    r = cli.run("break", "--stale", "--json")
    assert r.code == 0, r.describe()
    results = r.json()["results"]
    assert [(x["ticket"], x["action"]) for x in results] == [(acq["ticket"], "removed")]
    for g in (0, 1):
        assert not [f for f in cli.queue_files(g) if f.endswith((".ticket", ".fifo"))], g
    assert cli.run("status", "--json").json()["sets"] == []
