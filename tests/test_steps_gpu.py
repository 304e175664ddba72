"""The push's stream order on a GPU (StepLoop._order_streams, wxfer/runtime/steps.py): its CUDA
events are made once and recorded again every push, and each push still orders the side stream
after the training stream's work before it, with the push event complete only once that work
is (what the zero-copy writes wait for)."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from wxfer.runtime.steps import StepLoop  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def dev():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


def test_each_push_orders_the_side_stream_after_the_training_streams_work_with_the_same_events(dev):
    side = torch.cuda.Stream(dev)
    loop = SimpleNamespace(stream=side, device=dev, _events=None)
    x = torch.zeros(1 << 20, device=dev)
    got = torch.empty_like(x)
    made = None
    for step in (1, 2, 3):
        torch.cuda.synchronize(dev)
        torch.cuda._sleep(200_000_000)  # the training stream busy (~0.1 s) before it writes x
        x.fill_(float(step))
        ev = StepLoop._order_streams(loop, torch)
        if made is None:
            made = loop._events
        assert loop._events is made and ev is made[1]  # the same events, recorded again
        assert not ev.query()  # the push event waits for the training stream's work
        with torch.cuda.stream(side):
            got.copy_(x)  # a side-stream read after the order
        torch.cuda.synchronize(dev)
        assert ev.query() and bool((got == float(step)).all())


def test_the_side_streams_context_is_made_once_and_puts_back_the_callers_stream(dev):
    """StepLoop._on_side: the same StreamContext each push; inside it the side stream is current,
    after it the caller's own stream again (another one each time here)."""
    side = torch.cuda.Stream(dev)
    loop = SimpleNamespace(stream=side, device=dev, _side_ctx=None)
    made = None
    for _ in range(3):
        mine = torch.cuda.Stream(dev)
        with torch.cuda.stream(mine):
            ctx = StepLoop._on_side(loop, torch)
            made = made or ctx
            assert ctx is made
            with ctx:
                assert torch.cuda.current_stream(dev) == side
            assert torch.cuda.current_stream(dev) == mine
