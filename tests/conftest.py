"""Suite-wide fixtures: no test may leave a process behind (p2pd included), and nothing reaches the hub."""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import tempfile
import sys
import time

import psutil
import pytest


def _blas_threads_per_worker() -> None:
    """On pytest-xdist's workers (one per CPU), numpy's OpenBLAS and the native kernels' pool get this worker's share
    of the CPUs (OPENBLAS_NUM_THREADS, read when numpy loads OpenBLAS, and by core/runtime/kernels/cpu_threads.py;
    child processes inherit it), not every CPU each: BLAS threads spinning for a CPU another busy process holds made a
    64-token fp32 prefill of the real model 7x slower at load 9 (one process: 6.5-7.1 s on two threads, 0.8-1.0 s on
    one; docs/testing.md). A value already set is kept; a run without workers is left as it is."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if "PYTEST_XDIST_WORKER" not in os.environ or not workers.isdigit() or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, cpus // max(1, int(workers))))


_blas_threads_per_worker()

import hivekeeper.core  # noqa: E402 F401 - first: sets OpenBLAS's idle-thread timeout before numpy loads it, as the app does

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# Machines differ: the whole suite (child processes included) sees one CPU, an AVX2 + FMA x86-64 without AVX512,
# whatever runs it (core/machine/cpu_features.py). Tests of the other cases pin theirs with `cpu_flags` below.
# On a CPU that really lacks AVX2 the native kernels stay off whatever is pinned: tests of them say so and skip.
SUITE_CPU_FLAGS = "sse2 avx avx2 fma"
os.environ["HIVEKEEPER_CPU_FLAGS"] = SUITE_CPU_FLAGS
# ... and a 32 MiB last-level cache, whatever the host has (which measured decode rate a plan takes depends on it)
os.environ["HIVEKEEPER_LLC_MIB"] = "32"


def _isolate_user_folders() -> None:
    """Point settings, profiles, data and caches at a fresh folder for the whole run (child processes inherit it),
    so a developer's saved machine profile or settings never change what a test sees, and tests write nothing
    into the user's real folders."""
    root = tempfile.mkdtemp(prefix="hivekeeper-tests-")
    os.environ["HIVEKEEPER_CONFIG_DIR"] = os.path.join(root, "config")
    os.environ["HIVEKEEPER_DATA_DIR"] = os.path.join(root, "data")
    os.environ["XDG_CACHE_HOME"] = os.path.join(root, "cache")
    atexit.register(shutil.rmtree, root, ignore_errors=True)


_isolate_user_folders()


def _share_kernel_builds() -> None:
    """One folder for the native kernels' builds for the whole run (core/runtime/kernels/native_kernels.py,
    HIVEKEEPER_KERNEL_CACHE): pytest-xdist's workers inherit it from the process that starts them, and child processes
    (servers with an XDG_CACHE_HOME of their own) from the tests, so the kernels compile once per run, not once per
    worker and server (~30 s each on a busy machine). Set beforehand, the folder given is used (and kept)."""
    if not os.environ.get("HIVEKEEPER_KERNEL_CACHE"):
        root = tempfile.mkdtemp(prefix="hivekeeper-test-kernels-")
        os.environ["HIVEKEEPER_KERNEL_CACHE"] = root
        atexit.register(shutil.rmtree, root, ignore_errors=True)


_share_kernel_builds()

# Nothing run by the suite may dial the public Petals swarm: its built-in bootstrap peers are replaced by a loopback
# address where nothing listens (core/swarm/bootstrap.py; tests that need a swarm start their own on loopback).
NOWHERE_PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGhXeWpUMGj8kXKSH7HkQhxCrRvaSxqCQ6ifHYckDBkok"
os.environ["HIVEKEEPER_BOOTSTRAP_PEERS"] = NOWHERE_PEER


def _hypothesis_profiles() -> None:
    """Property tests (tests/planner/test_properties.py) run the "ci" profile unless HYPOTHESIS_PROFILE names another:
    the same examples every run (derandomized), so a failure in CI reproduces on any machine. "wide" is a longer,
    random search, run by hand: HYPOTHESIS_PROFILE=wide .venv/bin/python -m pytest tests/planner/test_properties.py
    "mutate" (tests/mutate.py) is "ci" without shrinking or explaining a failure: a mutant only needs the test to fail,
    and shrinking took minutes per mutant there (past the 120 s test timeout)."""
    from hypothesis import Phase, settings

    settings.register_profile("ci", derandomize=True, max_examples=40, deadline=None, database=None, print_blob=True)
    settings.register_profile("wide", max_examples=1000, deadline=None)
    settings.register_profile("mutate", settings.get_profile("ci"),
                              phases=(Phase.explicit, Phase.reuse, Phase.generate))
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_hypothesis_profiles()


def _become_subreaper() -> None:
    """Make the test process adopt its orphaned descendants (Linux), so a p2pd whose server was killed stays ours.

    Without this an orphan is re-parented to init and we could only find it by scanning every p2pd on the machine,
    which would also catch (and kill) daemons that other programs run.
    """
    if sys.platform.startswith("linux"):
        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


_become_subreaper()


def _has_children() -> bool:
    """Whether this process has any child, live or a zombie: one system call, where listing descendants reads every
    process's /proc entry (10-30 ms on a busy machine, twice per test). Every descendant has an ancestor that is our
    child (orphans are adopted: subreaper), so no child means no descendant."""
    if not hasattr(os, "waitid"):  # not on macOS: list them
        return True
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # WNOWAIT: a zombie stays for its parent to reap
    except ChildProcessError:
        return False
    return True


def watched_processes() -> set[int]:
    """PIDs of every live descendant of the test process (orphans included, thanks to the subreaper flag)."""
    if not _has_children():
        return set()
    return {child.pid for child in psutil.Process().children(recursive=True)}


_KILLED: set[int] = set()  # leftovers the checks below killed: nobody else waits for them


def _reap_adopted_zombies() -> None:
    """Collect exit statuses of adopted orphans (p2pd of killed servers) and of the leftovers the checks killed; tests
    only wait for their own children. A killed leftover's own children (the cc1 of a compiler driver whose server was
    killed mid-build) are adopted as zombies too: left there, they would be children of every later test."""
    if not _has_children():
        return
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE and (child.name() == "p2pd" or child.pid in _KILLED):
                os.waitpid(child.pid, os.WNOHANG)
                _KILLED.discard(child.pid)
        except (psutil.NoSuchProcess, ChildProcessError):
            pass


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


MAX_WORKERS = 4  # each worker loads torch and starts swarms of its own: more would trade memory for little time


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook (the `test` extra); without it, never called
def pytest_xdist_auto_num_workers(config) -> int:
    """`make test` runs the suite on `-n auto` pytest-xdist workers: one per CPU this process may use, at most
    MAX_WORKERS, and none (the tests run in this process) on a one-CPU machine. PYTEST_XDIST_AUTO_NUM_WORKERS
    still decides when set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0 if cpus < 2 else min(cpus, MAX_WORKERS)


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """In the process that ran pytest-xdist's workers, after they are shut down: nothing started by the suite may
    outlive it, such as the p2pd of a module fixture's swarm, which the per-test check below cannot see. What a
    worker leaves when it exits is adopted by this process (the subreaper), so it is seen here. (A run without
    workers keeps the per-test check only: this one has not yet been through a whole run without workers.)"""
    if _is_xdist_worker(session.config) or not getattr(session.config.option, "numprocesses", None):
        return
    deadline = time.monotonic() + 30.0  # workers finishing their exit
    leftovers = [pid for pid in watched_processes() if _alive(pid)]
    while leftovers and time.monotonic() < deadline:
        _reap_adopted_zombies()
        time.sleep(0.2)
        leftovers = [pid for pid in watched_processes() if _alive(pid)]
    described = kill_and_describe(leftovers)
    if described:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")  # after xdist's progress dots
            reporter.write_line("processes left behind by the run: " + "; ".join(described), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def kill_and_describe(pids) -> list[str]:
    """Kill each process still there, and collect the exit statuses that come to this process (the subreaper) within a
    few seconds; one 'pid name command' line for each."""
    described = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            described.append(f"{pid} {proc.name()} {' '.join(proc.cmdline()[:4])}")
            proc.kill()
            _KILLED.add(pid)
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + 5.0
    while _KILLED & watched_processes() and time.monotonic() < deadline:
        _reap_adopted_zombies()
        time.sleep(0.05)
    _KILLED.intersection_update(watched_processes())  # the others are gone, or reaped by their parents
    return described


@pytest.fixture
def cpu_flags(monkeypatch):
    """Pin the CPU flags this test (and its child processes) sees: `cpu_flags("avx2 fma avx512f avx512_bf16")`.
    What was decided from the flags before (native kernels on or off, the CPU's 16-bit dtype) is decided again."""
    from hivekeeper.core.machine import cpu_dtype
    from hivekeeper.core.runtime.kernels import native_kernels

    def pin(flags: str) -> None:
        monkeypatch.setenv("HIVEKEEPER_CPU_FLAGS", flags)
        native_kernels.forget()
        cpu_dtype.forget()

    yield pin
    monkeypatch.setenv("HIVEKEEPER_CPU_FLAGS", SUITE_CPU_FLAGS)
    native_kernels.forget()
    cpu_dtype.forget()


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves child processes or p2pd daemons running; kill them so the next test is clean."""
    before = watched_processes()
    yield
    _reap_adopted_zombies()
    deadline = time.monotonic() + 5.0
    leftovers = {pid for pid in watched_processes() - before if _alive(pid)}
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.1)
        leftovers = {pid for pid in leftovers if _alive(pid)}
    described = kill_and_describe(leftovers)
    if described:
        pytest.fail("processes left behind: " + "; ".join(described))


@pytest.fixture
def cli(capsys, monkeypatch):
    """`hivekeeper ARGS` run in this process, through the same `main()` the command runs: `cli("plan", "--json")`
    returns a CompletedProcess (returncode, stdout, stderr). For the variations of a feature whose one test already
    goes through a real `hivekeeper` child process: each child costs seconds of imports (torch) on a loaded machine.
    Only for commands that read no stdin and start no threads or servers that outlive them. OMP_NUM_THREADS is set
    as the suite's children get it, so a local run leaves this process's torch threads as they are."""
    import subprocess

    from hivekeeper.core.cli.main import main

    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()  # what the test printed before is not the command's
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
            code = exc.code if isinstance(exc.code, int) else 1
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["hivekeeper", *args], code, out.out, out.err)

    return run


# A plausible 2-core machine's figures (fixed, not this host's): RAM read B/s, fp32 matmul FLOP/s at decode and prefill
# shapes, disk read and write B/s
SUITE_PROFILE_FIGURES = {"ram_read": (10e9, "B/s"), "cpu_matmul_fp32_decode": (4e9, "FLOP/s"),
                         "cpu_matmul_fp32_prefill": (40e9, "FLOP/s"), "disk_read": (1e9, "B/s"),
                         "disk_write": (0.5e9, "B/s")}


@pytest.fixture(scope="session", autouse=True)
def suite_machine_profile():
    """A fixed machine profile for this machine's fingerprint in the suite's config folder, written once per process
    (each pytest-xdist worker has its own folder; children inherit it): `plan --hardware auto` then plans from these
    figures instead of measuring the host first (the quick measurement, 10-50 s, once per worker), and no plan
    depends on the host's speed. Tests of the first measurement point HIVEKEEPER_CONFIG_DIR at an empty folder of
    their own (test_plan_measures_first, the GUI's config_dir fixture)."""
    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.measurement import Measurement
    from hivekeeper.core.machine.profiles import new_profile, save_profile

    profile = new_profile(detect_hardware())
    profile.measurements = [Measurement(key, f"suite's fixed {key}", value, unit, 0.0, 1, 0.5,
                                        "fixed by tests/conftest.py, not measured", [value])
                            for key, (value, unit) in SUITE_PROFILE_FIGURES.items()]
    profile.measured_at, profile.threads = 1.7e9, 2
    return save_profile(profile)


@pytest.fixture
def measured_machine(suite_machine_profile):
    """measured_machine(config_folder): the suite's fixed profile copied into a test's own config folder, so a plan
    for this machine made there (a child's too) reads it rather than measuring the host first (10-50 s), where the
    test is about something else; returns the copy's path."""
    from pathlib import Path

    def copy(folder) -> Path:
        target = Path(folder) / "profiles" / suite_machine_profile.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(suite_machine_profile, target)
        return target

    return copy
