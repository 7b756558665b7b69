"""The forward-only ops' eager shortcut (ops._ForwardOnlyOp): plain eager calls run the function
without the dispatcher; tracing, dispatch modes and fake tensors still see the custom op."""

import ctypes

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infllmv2.ops import _ForwardOnlyOp


def _scale_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(2 * x)


def _unchecked(*args):
    """The ops here take CPU tensors, whose calls are not checked (ops._checked)."""


OP = _ForwardOnlyOp(_scale_into, "infllmv2_test::scale_into", ("out",), _unchecked)


@OP.register_fake
def _(x, out):
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_call_runs_the_function_and_bumps_the_written_arguments_versions(monkeypatch):
    def dispatched(*args):
        raise AssertionError("a plain eager call went through the dispatcher")

    monkeypatch.setattr(OP, "op", dispatched)
    x, out = torch.arange(4.0), torch.zeros(4)
    before = out._version
    OP(x, out)
    assert torch.equal(out, 2 * x)
    assert out._version > before


def test_dispatch_modes_see_the_op():
    x, out = torch.arange(4.0), torch.zeros(4)
    with _Recorder() as rec:
        OP(x, out)
    assert "infllmv2_test.scale_into.default" in rec.ops
    assert torch.equal(out, 2 * x)


def test_torch_compile_traces_the_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def f(x, out):
        OP(x, out)
        return out + 1

    x, out = torch.arange(4.0), torch.zeros(4)
    assert torch.equal(f(x, out), 2 * x + 1)
    assert graphs and "infllmv2_test.scale_into" in graphs[0].code


def test_fake_tensors_take_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x, out = mode.from_tensor(torch.arange(4.0)), mode.from_tensor(torch.zeros(4))
        OP(x, out)  # the fake implementation: the real function cannot run on fake tensors


def test_jit_trace_records_the_op():
    def f(x, out):
        OP(x, out)
        return out + 1

    x, out = torch.arange(4.0), torch.zeros(4)
    traced = torch.jit.trace(f, (x, out), check_trace=False)
    assert "infllmv2_test::scale_into" in str(traced.graph)
    out.zero_()
    assert torch.equal(traced(x, out), 2 * x + 1)


def _raw_double_into(x: torch.Tensor, out: torch.Tensor) -> None:
    # writes as the C library does, through the pointer: torch sees no in-place op
    src = (2 * x).contiguous()
    ctypes.memmove(out.data_ptr(), src.data_ptr(), out.numel() * out.element_size())


RAW = _ForwardOnlyOp(_raw_double_into, "infllmv2_test::raw_double_into", ("out",), _unchecked)


@RAW.register_fake
def _(x, out):
    return None


def test_inference_tensors_are_written_only_in_inference_mode():
    """As torch refuses an in-place op on an inference tensor outside inference mode, eagerly and
    under a dispatch mode alike (the raw write itself would not be seen)."""
    x = torch.arange(4.0)
    with torch.inference_mode():
        out = torch.zeros(4)
    for mode in (None, _Recorder()):
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
            if mode is None:
                RAW(x, out)
            else:
                with mode:
                    RAW(x, out)
    assert torch.equal(out, torch.zeros(4))
    with torch.inference_mode():
        RAW(x, out)
    assert torch.equal(out, 2 * x)
    normal = torch.zeros(4)
    RAW(x, normal)
    assert torch.equal(normal, 2 * x)
