"""Each sandbox's unpacking bucket (`pipeline/unpacking.py`): refilled by the clock up to
its size, one per sandbox, bounded in number, never for the time it sat full. (That
the exchange's calls charge it, on each engine: tests/integration/test_unpack_budget.py.)"""

from __future__ import annotations

from gateway.pipeline.unpacking import UnpackBudgets


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_refills_with_time_up_to_its_size() -> None:
    clock = _Clock()
    budgets = UnpackBudgets(1000, 100, clock=clock)
    a = budgets.for_sandbox("a")
    a.left -= 900
    clock.now = 2.0
    assert budgets.for_sandbox("a") is a and a.left == 300
    clock.now = 100.0
    assert budgets.for_sandbox("a").left == 1000
    assert budgets.for_sandbox("b") is not a and budgets.for_sandbox("b").left == 1000


def test_buckets_are_bounded_in_number() -> None:
    clock = _Clock()
    budgets = UnpackBudgets(1000, 1, clock=clock, max_keys=4)
    for i in range(4):
        budgets.for_sandbox(f"s{i}").left = 0  # (all spent: none is dropped as full)
    clock.now = 1.0
    budgets.for_sandbox("new")
    assert len(budgets._buckets) <= 4
    spent = budgets.for_sandbox("s3")
    assert spent.left < 1000  # (the newest spent one kept: not refilled whole)


def test_a_bucket_spent_after_it_was_full_is_not_refilled_for_that_time() -> None:
    """A full bucket is returned without reading the clock (most requests); once spent,
    it is refilled from the next request's time, not for the time it sat full."""
    clock = _Clock()
    budgets = UnpackBudgets(1000, 100, clock=clock)
    b = budgets.for_sandbox("b")
    clock.now = 50.0
    assert budgets.for_sandbox("b") is b and b.left == 1000
    b.left -= 1000  # (spent by the request at 50 s)
    clock.now = 51.0
    assert budgets.for_sandbox("b").left == 0  # (not 1000: it was full until 50)
    clock.now = 52.0
    assert budgets.for_sandbox("b").left == 100


def _exchange(dlp: object, excess: object) -> object:
    from gateway.core.client import Client
    from gateway.core.messages import Headers, RequestHead, ResponseHead
    from gateway.core.target import Target
    from gateway.core.trail import Trail
    from gateway.pipeline.exchange_state import ExchangeState

    state = ExchangeState(
        Trail(lambda line: None, lambda: None),  # type: ignore[arg-type,return-value]
        None, Client(("127.0.0.1", 1)), None,  # type: ignore[arg-type]
        RequestHead("GET", "/", Headers([])), Target("https", "up.test", 443, "/"),
        None, None, 0.0, dlp=dlp, excess=excess)  # type: ignore[arg-type]
    state.response_head = ResponseHead(200, "OK", Headers([("Content-Type", "text/plain")]))
    return state


def test_an_answers_runs_are_charged_to_its_own_sandbox() -> None:
    """`dlp: {answers: report}` unpacks an answer's compressed runs: what they give past
    16 times their size is charged to the bucket of the sandbox whose exchange it is,
    even while another's request was the last one read (it was charged to that one
    before the twenty-second session), and past it the answer is said unreadable, never
    refused."""
    import base64
    import gzip

    from gateway.core.dlp import DEFAULT, Dlp, Scanner
    from gateway.core.unpack_bounds import Excess, charge_to
    from gateway.pipeline.dlp_plans import Plan
    from gateway.pipeline.exchange_dlp import DlpCheck
    from gateway.pipeline.exchange_response import ResponseSide
    from gateway.services.dlp.library import build

    check = DlpCheck(Plan(Scanner(build(DEFAULT), b"salt"), Dlp(action="refuse", answers=True)),
                     "up.test", "p.yaml:3")
    mine, other = Excess(16 << 20, 1), Excess(40 << 20, 1)
    side = ResponseSide(_exchange(check, mine))  # type: ignore[arg-type]
    run = base64.b64encode(gzip.compress(b"\0" * (24 << 20), mtime=0))
    charge_to(other)  # (another exchange's request read last, at each step)
    side.data(b"log: " + run[:20_000], None, None)
    charge_to(other)
    side.data(run[20_000:] + b"\n", None, None)
    charge_to(other)
    side.end(None, None)
    assert other.left == 40 << 20 and mine.left < 0
    assert [f["detector"] for f in check.found] == ["unreadable"]
    assert "this sandbox's compressed data" in check.found[0]["reason"]
    charge_to(None)


def test_the_bucket_is_the_gateways_split_between_its_workers() -> None:
    """`limits.unpacked_excess` and its rate bound what a sandbox costs the gateway: each
    of N workers holds 1/N of both (each held the whole, N times it, before the
    twenty-second session); one process holds all."""
    from types import SimpleNamespace

    from gateway.config import load_config
    from gateway.runtime.building import Building

    config = load_config(None, {"SANDBOX_GATEWAY_WORKERS": "4"})
    for worker, share in ((None, 1), (0, 4), (3, 4)):
        made = Building._unpacking(SimpleNamespace(  # type: ignore[arg-type]
            config=config, worker=worker))
        assert (made.size, made.rate) == (256 * 2**20 // share, 16 * 2**20 // share)
