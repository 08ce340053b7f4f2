"""The Triton kernels against the fp32 reference, forward and backward, on this CPU under Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is first imported (triton's own library functions are decorated
at import), and torch imports triton as soon as dynamo or DTensor is used, so the kernels cannot be switched
to the interpreter inside the pytest process. They run in one spawned worker process that has the variable
from birth; this process and every other test keep their environment. The cases live in tests/kernels/cases.py
(also run on a GPU by tests/bench/gpu_kernels.sh); tolerances per dtype are stated there.
"""

from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker imports tests.kernels.cases

from tests.kernels import cases  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
DTYPES = pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
CASE_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def interpreter():
    """A worker process whose Triton runs kernels on CPU tensors (the interpreter)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned worker only; restored right after
        env.setenv("OMP_NUM_THREADS", "1")
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        assert pool.submit(cases.interpreter_active).result(timeout=CASE_TIMEOUT_S), "worker is not interpreting"
    yield lambda case, *args, **kwargs: pool.submit(case, *args, **kwargs).result(timeout=CASE_TIMEOUT_S)
    pool.shutdown(cancel_futures=True)


# single token with an odd hidden size; a few rows of 4097; batch x seq spread over several programs
# (the dweight partial sums of the backward then cover uneven row ranges).
@DTYPES
@pytest.mark.parametrize("shape", [(1, 4097), (2, 3, 4097), (4, 48, 96)], ids=str)
def test_rms_norm(interpreter, shape, dtype):
    interpreter(cases.rms_norm_case, shape, dtype)


@DTYPES
@pytest.mark.parametrize("shape", [(1, 4097), (2, 3, 4097), (8, 64, 96)], ids=str)
def test_swiglu(interpreter, shape, dtype):
    interpreter(cases.swiglu_case, shape, dtype)


# grouped-query k; no leading dims with odd head counts; one token with head_dim // 2 = 65 (not a power of 2)
@DTYPES
@pytest.mark.parametrize("q_shape,kv_heads", [((2, 16, 4, 64), 2), ((5, 3, 6), 1), ((1, 1, 3, 130), 3)], ids=str)
def test_apply_rope(interpreter, q_shape, kv_heads, dtype):
    interpreter(cases.rope_case, q_shape, kv_heads, dtype)


FLCE_CASES = {
    # several chunks of 16 tokens and a ragged last one, 30% of the targets ignored
    "chunked-ignored": dict(lead=(4, 33), hidden=64, vocab=1000, ignored=0.3, chunk_size=16),
    # a vocabulary larger than one block: the online softmax runs over several blocks; z-loss on
    "vocab-40000-zloss": dict(lead=(5,), hidden=32, vocab=40000, z_loss=1e-3),
    "single-token-4097": dict(lead=(1,), hidden=4097, vocab=300),
    # a custom ignore_index, half of the batch ignored, and an upstream gradient other than 1
    "ignore-index-1-scaled": dict(lead=(3, 7), hidden=40, vocab=500, ignore_index=-1, ignored=0.5, grad_scale=3.0),
}


@DTYPES
@pytest.mark.parametrize("name", list(FLCE_CASES))
def test_fused_linear_cross_entropy(interpreter, name, dtype):
    kw = dict(FLCE_CASES[name])
    interpreter(cases.flce_case, kw.pop("lead"), kw.pop("hidden"), kw.pop("vocab"), dtype, **kw)


@DTYPES
def test_fused_linear_cross_entropy_all_ignored_is_zero_with_zero_grads(interpreter, dtype):
    interpreter(cases.flce_all_ignored_case, dtype)


def test_fused_linear_cross_entropy_target_outside_vocab_is_nan(interpreter):
    interpreter(cases.flce_bad_target_case)


def test_fused_linear_cross_entropy_without_grad(interpreter):
    interpreter(cases.flce_no_grad_case)


def test_torch_compile_traces_around_the_ops(interpreter):
    interpreter(cases.compile_case)


def test_switch_modes_and_bad_mode():
    cases.switch_case("cpu")  # CPU tensors: no Triton involved, so it runs in this process


@pytest.mark.distributed
def test_dtensors_take_the_reference(interpreter):
    interpreter(cases.dtensor_case)  # in the worker: it starts (and ends) a one-rank gloo process group
