"""The host CPU account: each part is the CPU time of the thread that did it, a followed thread's remainder is named
after it, and with the threads it does not follow the parts add up to the process's CPU time without counting
anything twice."""

import threading
import time

import pytest

from hsx_dagster.core.storage import CpuAccount


def _burn(seconds: float) -> None:
    """Keep this thread's CPU busy for about ``seconds`` of its own CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_parts_are_their_threads_cpu_time_and_add_up_to_the_process():
    cpu = CpuAccount.started()

    def writer() -> None:
        with cpu.thread("writer_loop"):
            with cpu.part("write"):
                _burn(0.05)
            _burn(0.03)  # the loop's own work, outside any part

    with cpu.thread("main_loop"):
        thread = threading.Thread(target=writer)
        thread.start()
        with cpu.part("forward"):
            _burn(0.04)
        thread.join()
    unfollowed = threading.Thread(target=_burn, args=(0.02,))  # as PyTorch's pool would
    unfollowed.start()
    unfollowed.join()
    cpu.stop()
    seconds = cpu.seconds
    assert seconds["write"] == pytest.approx(0.05, abs=0.02)
    assert seconds["writer_loop"] == pytest.approx(0.03, abs=0.02)  # not the write's time again
    assert seconds["forward"] == pytest.approx(0.04, abs=0.02)
    assert seconds["other_threads"] >= 0.01  # the thread no part followed
    followed = sum(value for part, value in seconds.items() if part != "other_threads")
    assert followed <= cpu.process_s + 0.01  # nothing counted twice
    assert sum(seconds.values()) == pytest.approx(cpu.process_s, abs=1e-6)
    assert cpu.per_gb(2 * 10**9)["write"] == pytest.approx(seconds["write"] / 2, abs=1e-4)
