"""Naming the rank a hung job waits for from its ranks' stack dumps (kiln.trainer.observe.hang_report)."""

from __future__ import annotations

from kiln.trainer.observe.hang_report import MAIN_MARK, main_stack, stacks, suspects


def dump(main_frame: str, other_frame: str = "threading.py") -> str:
    return (f"{MAIN_MARK}0x00000000000000aa\n"
            f"Thread 0x00000000000000bb (most recent call first):\n  File \"/x/{other_frame}\", line 1 in run\n\n"
            f"Thread 0x00000000000000aa (most recent call first):\n  File \"/x/{main_frame}\", line 9 in step\n")


def test_the_rank_outside_the_collective_is_the_one_the_others_wait_for():
    waiting = dump("site-packages/torch/distributed/distributed_c10d.py")
    assert suspects({0: waiting, 1: dump("kiln/trainer/data/loader.py"), 2: waiting}) == [1]


def test_no_rank_is_named_when_all_or_none_wait_in_a_collective():
    waiting = dump("site-packages/torch/distributed/distributed_c10d.py")
    assert suspects({0: waiting, 1: waiting}) == []
    assert suspects({0: dump("a.py"), 1: dump("b.py")}) == []
    # a collective in another thread (a checkpoint upload) does not make the main thread a waiter
    assert suspects({0: dump("a.py", other_frame="torch/distributed/checkpoint/x.py"), 1: waiting}) == [0]


def test_a_real_dump_names_its_main_thread():
    text = stacks()
    assert text.startswith(MAIN_MARK)
    assert "test_a_real_dump_names_its_main_thread" in main_stack(text)
