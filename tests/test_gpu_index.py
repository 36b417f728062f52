"""A GPU index the machine does not have (``--gpu 7`` on a one-GPU box) is a usage error naming
the GPUs it has, for every command taking ``--gpu``, and never leaves a phantom ``gpu7`` in
``gpulock status``."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from cli_helpers import Cli, assert_clean_error, error_lines

import gpulock
from gpulock.core import devices, events
from gpulock.core.config import Config
from gpulock.core.errors import NoSuchGpu


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--gpu", "7", "--", "true"],
        ["evict", "--gpu", "7", "some-model"],
        ["history", "--gpu", "7"],
    ],
)
def test_a_gpu_the_machine_lacks_is_a_usage_error_naming_those_it_has(
    cli: Cli, args: list[str]
) -> None:
    cli.state.mkdir(mode=0o700)  # history reads one (and never makes it)
    r = cli.run(*args)
    assert_clean_error(r, 2)
    err = error_lines(r.stderr)[0]
    assert "gpu7 does not exist" in err and "gpu0" in err and "simulated" in err, r.describe()
    assert r.stdout == ""
    assert not cli.gpu_dir(7).exists()
    assert [g["gpu"] for g in cli.status()["gpus"]] == [0]


def test_two_simulated_gpus_are_both_named(cli: Cli) -> None:
    cli.simulate = "24GiB,12GiB"
    r = cli.run("run", "--gpu", "2", "--", "true")
    assert_clean_error(r, 2)
    assert "2 simulated GPUs: gpu0, gpu1" in error_lines(r.stderr)[0], r.describe()
    assert cli.run("run", "--gpu", "1", "--", "true").code == 0


def test_json_error_carries_the_usage_exit_code(cli: Cli) -> None:
    r = cli.run("evict", "--gpu", "7", "some-model", "--json")
    assert r.code == 2, r.describe()
    err = r.json()["error"]
    assert err["type"] == "NoSuchGpu" and err["exit_code"] == 2, err
    assert "gpu0" in err["message"], err


def test_history_of_a_gpu_the_log_knows_is_allowed(cli: Cli) -> None:
    cli.state.mkdir(mode=0o700)
    events.emit(cli.state, "acquire", gpu=5, ticket=1, pid=1, name="old-box")
    r = cli.run("history", "--gpu", "5", "--json")
    assert r.code == 0, r.describe()
    assert [e["name"] for e in r.json()["events"]] == ["old-box"]


def test_a_leftover_empty_queue_folder_is_not_shown_as_a_gpu(cli: Cli) -> None:
    cli.state.mkdir(mode=0o700)
    cli.gpu_dir(7).mkdir(mode=0o700)  # what `run --gpu 7` left before it was refused
    assert [g["gpu"] for g in cli.status()["gpus"]] == [0]
    assert "gpu7" not in cli.run("status").stdout


def test_library_acquire_refuses_it_too(tmp_path: Path) -> None:
    cfg = Config(simulate_bytes=(24 * 2**30,))
    with pytest.raises(NoSuchGpu) as caught:
        gpulock.acquire(gpu=3, config=cfg, state_dir=tmp_path / "state")
    assert caught.value.known == (0,) and caught.value.gpu == 3
    assert not (tmp_path / "state" / "gpu3").exists()
    again = pickle.loads(pickle.dumps(caught.value))  # noqa: S301
    assert str(again) == str(caught.value) and again.hint == caught.value.hint


def test_real_gpus_are_counted_from_the_driver_folder(tmp_path: Path) -> None:
    driver = tmp_path / "gpus"
    driver.mkdir()
    (driver / "0000:01:00.0").mkdir()  # one GPU, as /proc/driver/nvidia/gpus lists it
    env: dict[str, str] = {}
    assert devices.known_gpus(None, env, driver_dir=str(driver)) == ((0,), "NVIDIA")
    devices.check_gpu(0, None, env, driver_dir=str(driver))
    says = r"gpu7 does not exist: this machine has 1 NVIDIA GPU: gpu0"
    with pytest.raises(NoSuchGpu, match=says):
        devices.check_gpu(7, None, env, driver_dir=str(driver))
    # No driver folder: cannot tell, so nothing is refused (unknown is not "no GPU").
    assert devices.known_gpus(None, env, driver_dir=str(tmp_path / "none")) is None
    devices.check_gpu(7, None, env, driver_dir=str(tmp_path / "none"))
    assert json.dumps(NoSuchGpu(7, (0,), "NVIDIA").known)  # plain data
