"""The hint for a missing extra gives the pip command that works where this gpulock was
installed from: a checkout (``pip install -e '.[serve]'``), a local folder, a VCS URL, an
archive or the package index, with the running interpreter's own pip."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from cli_helpers import REPO, Cli, assert_clean_error, error_lines

from gpulock.core import extras


@pytest.mark.parametrize(
    ("origin", "cwd", "expected"),
    [
        (None, "/elsewhere", "'gpulock[serve]'"),  # from the index
        ({"url": "file:///src/gpulock", "dir_info": {"editable": True}}, "/src/gpulock",
         "-e '.[serve]'"),
        ({"url": "file:///src/gpulock", "dir_info": {"editable": True}}, "/elsewhere",
         "-e '/src/gpulock[serve]'"),
        ({"url": "file:///src/gpu%20lock", "dir_info": {}}, "/elsewhere",
         "'/src/gpu lock[serve]'"),
        ({"url": "https://example.org/gpulock.git",
          "vcs_info": {"vcs": "git", "commit_id": "ab12", "requested_revision": "v0.1"}},
         "/elsewhere", "'gpulock[serve] @ git+https://example.org/gpulock.git@v0.1'"),
        ({"url": "file:///tmp/gpulock-0.1.0-py3-none-any.whl", "archive_info": {}},
         "/elsewhere", "'gpulock[serve] @ file:///tmp/gpulock-0.1.0-py3-none-any.whl'"),
    ],
)  # fmt: skip
def test_requirement_follows_where_gpulock_came_from(
    origin: dict[str, object] | None, cwd: str, expected: str
) -> None:
    assert extras.requirement("serve", origin=origin, cwd=Path(cwd)) == expected


def test_a_checkout_gets_an_editable_install_of_itself() -> None:
    assert extras.PACKAGE_ROOT == REPO  # the code under test runs from this checkout
    here = extras.install_hint("serve", cwd=REPO)
    assert here.endswith(" install -e '.[serve]'"), here
    away = extras.install_hint("serve", cwd=Path("/"))
    assert away.endswith(" install -e " + shlex.quote(f"{REPO}[serve]")), away
    pip = here.split(" install ")[0]
    assert pip in ("pip", f"{shlex.quote(sys.executable)} -m pip"), here


def test_a_folder_without_gpulocks_pyproject_is_no_checkout(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert not extras._is_checkout(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "gpulock"\n')
    assert extras._is_checkout(tmp_path)


def test_serve_without_its_extra_names_the_checkout_form(cli: Cli) -> None:
    code = (
        "import sys\n"
        "sys.modules['uvicorn'] = None  # as if the serve extra were not installed\n"
        "from gpulock.serve.cli import main\n"
        "sys.exit(main([]))\n"
    )
    r = cli.run("-c", code, argv0=[sys.executable], cwd=REPO)
    assert_clean_error(r, 1)
    assert "gpulock serve needs its extra" in error_lines(r.stderr)[0], r.describe()
    (hint,) = [line for line in r.stderr.splitlines() if line.startswith("hint:")]
    assert hint.endswith(" install -e '.[serve]'"), r.describe()
    assert "'gpulock[serve]'" not in r.stderr


def test_the_tiny_model_writer_without_the_llama_extra_names_it(cli: Cli) -> None:
    out = cli.root / "tiny.gguf"
    code = (
        "import runpy, sys\n"
        "sys.modules['gguf'] = None  # as if the llama extra were not installed\n"
        f"sys.argv = ['tiny_model', {str(out)!r}]\n"
        "runpy.run_module('gpulock.router.tiny_model', run_name='__main__', alter_sys=True)\n"
    )
    r = cli.run("-c", code, argv0=[sys.executable], cwd=REPO)
    assert_clean_error(r, 1)
    assert "writing a GGUF model needs the llama extra" in error_lines(r.stderr)[0], r.describe()
    (hint,) = [line for line in r.stderr.splitlines() if line.startswith("hint:")]
    assert hint.endswith(" install -e '.[llama]'"), r.describe()
    assert not out.exists()


def test_the_tiny_model_writer_into_an_unwritable_place_is_a_clean_error(cli: Cli) -> None:
    (cli.root / "a-file").write_text("not a folder")
    out = cli.root / "a-file" / "tiny.gguf"
    r = cli.run("-m", "gpulock.router.tiny_model", str(out), argv0=[sys.executable], cwd=REPO)
    assert_clean_error(r, 1)
    assert f"cannot write {out}" in error_lines(r.stderr)[0], r.describe()


def test_a_cluster_without_its_extra_names_the_checkout_form(cli: Cli, tmp_path: Path) -> None:
    config = tmp_path / "gpulock.yaml"
    config.write_text("cluster:\n  redis: redis://127.0.0.1:6379/0\n  host: a\n")
    code = (
        "import sys\n"
        "sys.modules['redis'] = None  # as if the cluster extra were not installed\n"
        "from gpulock.cluster.cli import main\n"
        f"sys.exit(main(['--config', {str(config)!r}, '--state-dir', {str(tmp_path / 's')!r}]))\n"
    )
    r = cli.run("-c", code, argv0=[sys.executable], cwd=REPO)
    assert_clean_error(r, 1)
    assert "needs the redis client" in error_lines(r.stderr)[0], r.describe()
    (hint,) = [line for line in r.stderr.splitlines() if line.startswith("hint:")]
    assert hint.endswith(" install -e '.[cluster]'"), r.describe()
    assert "'gpulock[cluster]'" not in r.stderr
