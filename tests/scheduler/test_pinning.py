"""Engines confined to CPUs of their own (EngineSettings.cpus), as the scheduler bench runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kubestar.engine.launch import EngineSettings, one_cpu_each, parse_cpu_list


def test_cpu_lists_use_linux_syntax() -> None:
    assert parse_cpu_list("0") == [0]
    assert parse_cpu_list("0-2,5, 7") == [0, 1, 2, 5, 7]
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    with pytest.raises(ValueError):
        EngineSettings(model="m", cpus="2-1")


def test_pinned_cpu_engines_bind_their_openmp_threads_to_the_same_cpus() -> None:
    assert EngineSettings(model="m", cpus="1,0").environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    unpinned = EngineSettings(model="m").environment()
    assert unpinned.get("VLLM_CPU_OMP_THREADS_BIND") in (
        "nobind",
        os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
    )


def test_the_engine_process_and_its_children_get_the_affinity() -> None:
    cpu = min(os.sched_getaffinity(0))
    settings = EngineSettings(model="m", cpus=str(cpu))
    code = (
        "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)));"
        "print(subprocess.run([sys.executable, '-c', 'import os; "
        "print(sorted(os.sched_getaffinity(0)))'], capture_output=True, text=True).stdout)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        preexec_fn=settings.preexec,
        check=True,
        timeout=60,
    )
    assert done.stdout.split() == [f"[{cpu}]", f"[{cpu}]"]


def test_one_cpu_each_or_none_when_there_are_too_few() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert one_cpu_each(1) == [str(allowed[0])]
    assert one_cpu_each(len(allowed) + 1) == [""] * (len(allowed) + 1)
