"""``python -m sparse_hvd.doctor`` in the project's environment and in broken ones."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
NO_CONTROLLER = os.path.join(HERE, "fixtures", "horovod_without_controllers")


def doctor(*args, env=None):
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("OMPI_", "PMI", "HOROVOD_", "SLURM_"))}
    environment.update(env or {})
    result = subprocess.run([sys.executable, "-m", "sparse_hvd.doctor", *args],
                            capture_output=True, text=True, env=environment, timeout=300)
    return result.returncode, result.stdout + result.stderr


def test_the_projects_environment_is_healthy():
    code, output = doctor()
    assert code == 0, output
    for part in ("[ ok ] TensorFlow", "[ ok ] Horovod", "[ ok ] controller", "[ ok ] native kernels",
                 "[ ok ] one step"):
        assert part in output, output
    assert "everything sparse_hvd needs is here" in output


def test_kernels_turned_off_fail_unless_the_fallback_is_allowed():
    code, output = doctor(env={"SPARSE_HVD_NATIVE": "0"})
    assert code == 1
    assert "[FAIL] native kernels: turned off (SPARSE_HVD_NATIVE=0)" in output
    code, output = doctor("--allow-fallback", env={"SPARSE_HVD_NATIVE": "0"})
    assert code == 0, output
    assert "[info] native kernels: turned off" in output


def test_kernels_that_cannot_be_built_fail(tmp_path):
    # an empty kernel cache and a compiler that always fails: the library is missing and
    # cannot be made
    code, output = doctor(env={"SPARSE_HVD_KERNEL_CACHE": str(tmp_path), "CXX": "/bin/false"})
    assert code == 1, output
    assert "[FAIL] native kernels: cannot be built or loaded: compiling sparse_hvd's kernels failed" in output


def test_a_horovod_without_the_launchers_controller_fails():
    env = {"PYTHONPATH": NO_CONTROLLER + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code, output = doctor("--controller", "mpi", env=env)
    assert code == 1
    assert "[FAIL] controller: MPI is not built into this Horovod" in output
    # launched by mpirun, the controller it implies is checked without being named
    code, output = doctor(env={**env, "OMPI_COMM_WORLD_SIZE": "2"})
    assert code == 1 and "[info] launcher: this process runs under mpirun" in output
    assert "[FAIL] controller: MPI is not built" in output
    code, output = doctor(env=env)
    assert code == 1 and "[FAIL] controller: neither MPI nor Gloo" in output


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_each_built_controller_passes_when_asked_for(controller):
    code, output = doctor("--controller", controller)
    assert code == 0, output
    assert f"[ ok ] controller: {controller.upper()} is built in" in output


@pytest.mark.parametrize("removes_output", [True, False])
def test_a_failed_compile_says_what_the_compiler_said_and_leaves_no_temporary(
        tmp_path, monkeypatch, removes_output):
    """g++ deletes its output when it fails, /bin/false does not: either way the error is the
    compiler's own message and no temporary file is left behind."""
    from sparse_hvd.kernels import build

    compiler = tmp_path / "failing-compiler"
    removal = 'rm -f "$output"' if removes_output else ":"
    compiler.write_text(
        "#!/bin/sh\n"
        'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then output="$2"; fi; shift; done\n'
        f"{removal}\n"
        'echo "kernel.cc:1: error: this compiler refuses" >&2\n'
        "exit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    target = tmp_path / "cache" / "key" / build.NAME
    with pytest.raises(build.BuildError, match="this compiler refuses"):
        build.compile_library(str(target))
    assert os.listdir(target.parent) == []
